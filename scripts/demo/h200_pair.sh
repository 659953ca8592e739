#!/usr/bin/env bash
# One H200 call: train the demo drafter on prepared (regenerated) data sets, then measure the new
# pair there: `hf2q bench --slots 1,2,4,8` (batched DFlash vs plain batched decoding, tau),
# `hf2q generate` on the default demo prompt (plain vs DFlash, 3 alternating runs each), and as
# many of the CUDA-only kernel tests as the remaining time allows.
#
# On the GPU machine, after MLX is installed (shared/device/README.md), from the repository root:
#   DATA=/root/hf2q-stash/gpu2 PREPARED="a.npz b.npz" bash scripts/demo/h200_pair.sh
# or, to measure the pair already in the package (hf2q/demo/) without training:
#   TRAIN=0 bash scripts/demo/h200_pair.sh
# Everything lands in $OUT as it is produced (a call cut short still returns what it wrote).
set -uo pipefail
: "${OUT:?set OUT}"
TRAIN=${TRAIN:-1}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RUN=${RUN:-/root/hf2q-stash/draft-run2}
t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

# 1. Train (TF32 matmuls for the float32 drafter training; the measurements below keep it off).
if [ "$TRAIN" = 1 ]; then
  : "${DATA:?set DATA (target/ and heldout.jsonl)}"
  MLX_ENABLE_TF32=1 RUN=$RUN DATA=$DATA bash scripts/demo/train_draft_gpu.sh
  since "trained"
  [ -f "$OUT/draft/config.json" ] || exit 1
  PAIR="-m $DATA/target -d $OUT/draft"
else
  PAIR=""  # the embedded pair
fi
export MLX_ENABLE_TF32=0

# 2. The default demo prompt, plain vs DFlash, 256 tokens, alternating (cheap: before the bench).
printf '"""Python Character Mapping Codec"""\n' > "$OUT/demo_prompt.txt"
for r in 1 2 3; do for m in --dflash --no-dflash; do
  # shellcheck disable=SC2086
  timeout 60 python3 -m hf2q generate $m $PAIR --no-chat --prompt-file "$OUT/demo_prompt.txt" \
    -n 256 --json 2>> "$OUT/generate.err" | tail -n 1 >> "$OUT/generate.jsonl"
done; done
since "generate done"

# 3. Batched DFlash on the pair.
mkdir -p "$OUT/bench"
OUT=$OUT/bench PARTS=demo PAIR=$PAIR bash benchmarks/slots_h200.sh
since "bench done"

# 4. CUDA-only kernel tests not yet run on the H200 in full (stops where the call's time ends).
python3 -m pytest -q -x tests/test_kernels_attention.py tests/test_kernels_layers.py \
  > "$OUT/cuda_tests.log" 2>&1
since "tests exit $?"
tail -n 3 "$OUT/cuda_tests.log"
