#!/usr/bin/env bash
# Step 3 of make_demo.sh on an NVIDIA GPU (MLX CUDA): train the demo drafter with `hf2q train-draft`
# against the demo target, within a wall-time budget, then measure the pair with `hf2q bench`.
#
# Inputs (relative to the repository root): $DATA/target (the demo target), $DATA/train.jsonl.xz and
# $DATA/heldout.jsonl (runs/demo/text/*.jsonl from prepare_data.py). Outputs in $OUT: draft/ (the
# drafter, z-lab format, with train_log.json), probe.json, train.log, bench-demo.json/.log.
#
# A 30-step probe measures seconds per step on this machine first; the real run then gets as many
# steps as fit in TRAIN_MINUTES (so the learning-rate schedule completes), with --max-minutes as
# a guard.
set -uo pipefail
: "${OUT:?set OUT}"
DATA=${DATA:-runs/gputrain}
TRAIN_MINUTES=${TRAIN_MINUTES:-3.5}
export PYTHONUNBUFFERED=1
W=$(mktemp -d)
[ -f "$DATA/train.jsonl" ] || xz -dkc "$DATA/train.jsonl.xz" > "$W/train.jsonl"
TRAIN=${TRAIN:-$W/train.jsonl}
COMMON=(-t "$DATA/target" --data "$TRAIN" --eval-data "$DATA/heldout.jsonl"
  --layers 2 --target-layer-ids 1,3,5 --block-size 16 --seq-len 256
  --batch-size 32 --anchors-per-seq 32 --lr 1e-3 --seed 0 --feature-cache-gb 40)
t0=$(date +%s)
python3 -m hf2q train-draft "${COMMON[@]}" -o "$W/probe" --max-seqs 512 --no-regenerate \
  --steps 30 --eval-prompts 0 --json > "$OUT/probe.log" 2>&1
tail -n 1 "$OUT/probe.log" > "$OUT/probe.json"
STEPS=$(python3 - "$OUT/probe.json" "$TRAIN_MINUTES" <<'PY'
import json, sys
log = json.loads(open(sys.argv[1]).read())
per_step = log["train_s"] / log["steps"]
print(max(100, int(float(sys.argv[2]) * 60 / per_step * 0.92)))
PY
) || { echo "probe failed"; tail -n 20 "$OUT/probe.log"; exit 1; }
echo "[$(( $(date +%s) - t0 ))s] probe done: $STEPS steps fit in $TRAIN_MINUTES minutes"
python3 -m hf2q train-draft "${COMMON[@]}" -o "$OUT/draft" --max-seqs 16384 \
  --regenerate --regen-prompt-tokens 64 --regen-batch 1024 \
  --steps "$STEPS" --max-minutes "$TRAIN_MINUTES" --eval-every 100000 \
  --eval-prompts 16 --eval-max-tokens 128 > "$OUT/train.log" 2>&1
echo "[$(( $(date +%s) - t0 ))s] train-draft exit $?"
grep -E "^(eval|train|regenerate 1|saved|features target)" "$OUT/train.log" | tail -n 8
rm -rf "$OUT/draft/checkpoint"  # the optimizer state: not needed to use or ship the drafter
if [ -f "$OUT/draft/config.json" ]; then
  timeout "${BENCH_S:-150}" python3 -m hf2q bench -m "$DATA/target" -d "$OUT/draft" \
    --slots 1,2,4,8 --gen-tokens 128 --trials 3 --warmup 1 --json --out "$OUT/bench-demo.json" \
    > "$OUT/bench-demo.log" 2>&1
  echo "[$(( $(date +%s) - t0 ))s] bench exit $?"
  tail -c 2500 "$OUT/bench-demo.log"
fi
