#!/usr/bin/env bash
# hf2q bench (batched DFlash) on the lent H200: costs on a random Qwen3.5-4B-shaped pair, then tau
# on the embedded demo pair when this tree has it. Writes JSON reports and logs into $OUT.
#
# On the GPU machine, after MLX is installed (shared/device/README.md), from the repository root:
#   bash .device/s2/install.sh && bash benchmarks/slots_h200.sh
# Budget: about 4-5 minutes on an H200 for part 1 (build about 20 s, kernels compile during the
# warm-up); part 2 up to DEMO_BENCH_S (300 s: 150 s was not enough for the demo pair at 128 tokens).
# SHAPE=small runs the same on a CPU in a few minutes (a check of this script, not a result).
# PARTS=demo runs part 2 only; PAIR="-m TARGET -d DRAFT" measures that pair instead of the
# embedded one (e.g. a drafter just trained, before it is installed in the package). SLOTS (default
# 1,2,4,8) picks part 1's slot counts; part 1 runs without lookup drafts (LOOKUP=1 allows them).
set -uo pipefail
: "${OUT:?set OUT to the folder for the reports}"
SHAPE=${SHAPE:-4b}
PARTS=${PARTS:-synthetic,demo}
PAIR=${PAIR:-}
DTYPE=${DTYPE:-bfloat16}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true

# 1. Costs: round time and its split, E and slot scaling (random weights: tau about 1).
if [[ $PARTS == *synthetic* ]]; then
timeout 420 python3 benchmarks/slots_synthetic.py --shape "$SHAPE" --dtype "$DTYPE" \
  --slots "${SLOTS:-1,2,4,8}" --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 \
  $([ "${LOOKUP:-0}" = 1 ] && echo --lookup) --out "$OUT/slots-$SHAPE.json" > "$OUT/slots-$SHAPE.log" 2>&1
echo "synthetic $SHAPE: exit $?"
python3 benchmarks/bench_rows.py "$OUT/slots-$SHAPE.json" || tail -n 20 "$OUT/slots-$SHAPE.log"
fi

# 2. Tau on the embedded demo pair (skipped when this tree has none) or on $PAIR.
if [[ $PARTS != *demo* ]]; then
  :
elif [ -n "$PAIR" ] || { [ -f hf2q/demo/target/config.json ] && [ -f hf2q/demo/draft/config.json ]; }; then
  # shellcheck disable=SC2086  # PAIR is a list of arguments
  timeout "${DEMO_BENCH_S:-300}" python3 -m hf2q bench $PAIR --slots 1,2,4,8 --gen-tokens 128 --trials 3 --warmup 1 \
    --json --out "$OUT/slots-demo.json" > "$OUT/slots-demo.log" 2>&1
  echo "demo pair: exit $?"
  tail -c 1500 "$OUT/slots-demo.log"
else
  echo "demo pair: not in this tree (hf2q/demo/), tau run skipped"
fi
