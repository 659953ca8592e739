#!/usr/bin/env bash
# Step 3 of make_demo.sh on an NVIDIA GPU (MLX CUDA): train the demo drafter with `hf2q train-draft`
# against the demo target, in one or more calls of a time-limited machine.
#
# Inputs (relative to the repository root): $DATA/target (the demo target), $DATA/train.jsonl.xz and
# $DATA/heldout.jsonl (runs/demo/text/*.jsonl from prepare_data.py).
# State: $RUN, the train-draft output folder. It should outlive one call (a folder the machine keeps
# while warm): when $RUN holds a checkpoint the run resumes it (the regenerated data set is in the
# checkpoint, so it is not regenerated again). TOTAL_MINUTES is the run's whole training-time budget
# (--max-minutes counts the time of earlier calls too); the learning-rate schedule spans STEPS.
# PREPARED="a.npz b.npz": train on data sets an earlier run prepared (OUT/checkpoint/dataset.npz,
# e.g. regenerated on another machine) instead of tokenizing and regenerating the text again.
# LAYERS, BATCH, LR and EVAL_PROMPTS set the drafter's depth, sequences per step, peak learning
# rate and the held-out prompts of each tau measurement (0: measure afterwards, elsewhere).
# Outputs in $OUT: probe.log (which batch MLX's backend takes), train.log, and draft/ (the drafter,
# z-lab format, with train_log.json, without the optimizer checkpoint).
set -uo pipefail
: "${OUT:?set OUT}"
DATA=${DATA:-runs/gputrain}
RUN=${RUN:-/root/hf2q-stash/draft-run}
TOTAL_MINUTES=${TOTAL_MINUTES:-8}
STEPS=${STEPS:-24000}
MAX_SEQS=${MAX_SEQS:-16384}
PREPARED=${PREPARED:-}
LAYERS=${LAYERS:-2}
BATCH=${BATCH:-32}
LR=${LR:-1e-3}
EVAL_PROMPTS=${EVAL_PROMPTS:-16}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
W=$(mktemp -d)
if [ -f "$RUN/checkpoint/state.json" ]; then
  MODE=(--resume)
  REGEN_BATCH=${REGEN_BATCH:-64}
  echo "resuming $RUN"
elif [ -n "$PREPARED" ]; then
  MODE=()
  REGEN_BATCH=64
else
  MODE=()
  # The widest batch that MLX's backend runs here (regeneration and feature capture).
  REGEN_BATCH=$(python3 scripts/demo/probe_batch.py "$DATA/target" 512 256 128 64 32 2> "$OUT/probe.log" | tail -n 1)
  cat "$OUT/probe.log"
  [ "${REGEN_BATCH:-0}" -gt 0 ] || { echo "no batch size works"; exit 1; }
  echo "[$(( $(date +%s) - t0 ))s] regeneration batch $REGEN_BATCH"
fi
if [ -n "$PREPARED" ]; then
  SOURCE=(--no-regenerate)
  for f in $PREPARED; do SOURCE+=(--data "$f"); done
else
  [ -f "$DATA/train.jsonl" ] && TRAIN=$DATA/train.jsonl || { xz -dkc "$DATA/train.jsonl.xz" > "$W/train.jsonl"; TRAIN=$W/train.jsonl; }
  SOURCE=(--data "$TRAIN" --max-seqs "$MAX_SEQS" --regenerate --regen-prompt-tokens 64)
fi
python3 -m hf2q train-draft -t "$DATA/target" "${SOURCE[@]}" --eval-data "$DATA/heldout.jsonl" \
  --layers "$LAYERS" --target-layer-ids 1,3,5 --block-size 16 --seq-len 256 \
  --batch-size "$BATCH" --anchors-per-seq 32 --lr "$LR" --seed 0 --feature-cache-gb 40 \
  -o "$RUN" "${MODE[@]}" --regen-batch "$REGEN_BATCH" \
  --steps "$STEPS" --max-minutes "$TOTAL_MINUTES" --eval-every "${EVAL_EVERY:-4000}" \
  --eval-prompts "$EVAL_PROMPTS" --eval-max-tokens 128 >> "$OUT/train.log" 2>&1
rc=$?
echo "[$(( $(date +%s) - t0 ))s] train-draft exit $rc"
grep -E "^(eval|regenerate [0-9]+/|features|time|saved|train )" "$OUT/train.log" | tail -n 12
grep -E "^step" "$OUT/train.log" | tail -n 2
if [ -f "$RUN/config.json" ]; then
  mkdir -p "$OUT/draft"
  cp "$RUN"/*.json "$RUN"/*.safetensors "$OUT/draft/"
fi
exit $rc
