#!/usr/bin/env bash
# Rebuild the embedded demo pair (hf2q/demo/) from scratch, with the fixed seeds of the scripts.
#
#   1. corpus + tokenizer from this machine's Python stdlib      (CPU, ~20 s)
#   2. the target, trained from scratch with torch                (GPU: ~6 min; CPU: hours)
#   3. its DFlash drafter, trained with `hf2q train-draft` on MLX (GPU; a CPU takes hours)
#   4. install both into the package, 5. measure the quality bars (CPU, the machine that matters)
#
# Everything generated goes to runs/demo/ (git-ignored); the logs that are committed go to
# scripts/demo/logs/. Step 2 on an NVIDIA GPU (what the shipped target used):
#   python3 scripts/demo/train_target.py --data runs/demo/data --out $OUT/target --device cuda --minutes 5
# then copy $OUT/target to runs/demo/target and run this script with SKIP_TARGET=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ -z "${LD_PRELOAD:-}" ] && [ -e "$OPENBLAS" ]; then
  export LD_PRELOAD=$OPENBLAS  # MLX's CPU matmuls: the wheel's reference BLAS is ~38x slower
fi

$PY scripts/demo/prepare_data.py --out runs/demo/data --text-out runs/demo/text

if [ -z "${SKIP_TARGET:-}" ]; then
  $PY scripts/demo/train_target.py --data runs/demo/data --out runs/demo/target \
    --device "${DEVICE:-auto}" --minutes "${TARGET_MINUTES:-5}"
fi

# 3. The drafter. The shipped one (docs/BENCHMARKS.md, "The embedded demo pair"; since 2026-12-03)
# was trained on four data sets of the target's own greedy continuations, one per seed and
# prompt length, and one training run:
#   a-d. 16384 sampled 256-token chunks of the training files each, seed i and prompts of
#        64 / 48 / 96 / 32 tokens (64536 sequences; regenerated on the H200 in four processes at
#        once, batch 64: scripts/demo/h200_regen.sh),
#   e.   3 drafter layers trained on all four (H200: scripts/demo/h200_retrain.sh, 9000 steps,
#        147 s of steps).
# This script runs the same recipe on whatever MLX device it has (on a CPU, regenerating and
# training take hours: DRAFT_STEPS scales the training down). A data set is prepared by a
# one-step run: its OUT/checkpoint/dataset.npz is what later runs take as --data.
prep() {  # prep NAME SEED PROMPT_TOKENS MAX_SEQS
  PY=$PY bash scripts/demo/regen_set.sh runs/demo/target runs/demo/text/train.jsonl \
    runs/demo/text/heldout.jsonl "runs/demo/prep-$1" "$2" "$3" "$4"
}
prep a 0 64 16384
prep b 1 48 16384
prep c 2 96 16384
prep d 3 32 16384
$PY -m hf2q train-draft -t runs/demo/target -o runs/demo/draft --force \
  --data runs/demo/prep-{a,b,c,d}/checkpoint/dataset.npz \
  --eval-data runs/demo/text/heldout.jsonl --eval-prompts 0 \
  --layers 3 --target-layer-ids 1,3,5 --block-size 16 --seq-len 256 \
  --batch-size 32 --anchors-per-seq 32 --lr 1e-3 --seed 0 --feature-cache-gb 40 \
  --steps "${DRAFT_STEPS:-9000}"

$PY scripts/demo/install_pair.py --target runs/demo/target --draft runs/demo/draft
$PY scripts/demo/eval_pair.py --target hf2q/demo/target --draft hf2q/demo/draft \
  --data runs/demo/data --text runs/demo/text --out scripts/demo/logs/eval_pair.json
