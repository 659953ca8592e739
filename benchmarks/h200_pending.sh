#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh) for what session 15 left unmeasured on a GPU:
# 1. benchmarks/forward_build.py --synthetic 4b: Python time to build a decode and a verify
#    forward through the runners (layer choices now kept per layer function, commit e9b4e8e;
#    session 15's profile: ~2.0 / 2.3 ms before).
# 2. benchmarks/prefill_cost.py --synthetic 4b: prefill with HF2Q_PREFILL_RUNNERS=0 / 1, alternating.
# 3. benchmarks/plain_ab.py --synthetic 4b: plain decoding ms/token with HF2Q_COMPILE_FORWARD
#    0 / 1 (a whole decode step as one compiled graph), alternating, tokens compared.
# 4. benchmarks/slots_synthetic.py --shape 4b --slots 1,4: the loop's plain step, round and E.
# 5. CUDA tests ($TESTS) in the time left (default: the compiled step, prefill runners, flush).
# NODES=1 first counts and times the graph nodes of a 4-slot round of the 4B shape
# (benchmarks/graph_nodes.py --slots 4 --time: why a 4-slot round costs 17.4 ms against 12.2 for
# one sequence, session 15 run 2). SHAPE=small runs the same on a CPU (a check of the script).
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S=$(date +%s)
SHAPE=${SHAPE:-4b}
if [ "${NODES:-0}" = 1 ]; then
  timeout 150 python3 benchmarks/graph_nodes.py --synthetic "$SHAPE" --prompt-tokens 256 --slots 4 \
    --modes dflash,plain --gen-tokens 24 --time --out "$OUT/nodes4.json" > "$OUT/nodes4.log" 2>&1
  echo "nodes exit $? [$(( $(date +%s) - S ))s]"; grep -v '^{' "$OUT/nodes4.log" | cut -c1-240
fi
timeout 150 python3 benchmarks/forward_build.py --synthetic "$SHAPE" --reps 100 \
  --out "$OUT/forward_build.json" > "$OUT/forward_build.log" 2>&1
echo "forward_build exit $? [$(( $(date +%s) - S ))s]"; tail -n 1 "$OUT/forward_build.log" | cut -c1-400
timeout 200 python3 benchmarks/prefill_cost.py --synthetic "$SHAPE" --prompt-tokens "${PROMPTS:-1024,4096}" \
  --reps 3 --out "$OUT/prefill_cost.json" > "$OUT/prefill_cost.log" 2>&1
echo "prefill_cost exit $? [$(( $(date +%s) - S ))s]"; grep '^{"prompt' "$OUT/prefill_cost.log"
timeout 150 python3 benchmarks/plain_ab.py --synthetic "$SHAPE" --tokens 128 --runs 5 \
  --out "$OUT/plain_ab.json" > "$OUT/plain_ab.log" 2>&1
echo "plain_ab exit $? [$(( $(date +%s) - S ))s]"; tail -n 1 "$OUT/plain_ab.log" | cut -c1-400
SHAPE=$SHAPE VARIANTS=- SLOTS=1,4 TESTS=none VARIANT_S=200 bash benchmarks/h200_variants.sh
t=$(( ${BUDGET:-560} - ($(date +%s) - S) ))
# shellcheck disable=SC2086  # TESTS is a list of paths
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m pytest -q -x ${TESTS:-tests/test_kernels_forward.py tests/test_runtime_prefill_runners.py tests/test_runtime_flush.py} \
    > "$OUT/cuda_tests.log" 2>&1
  echo "tests exit $? [$(( $(date +%s) - S ))s]"; tail -n 3 "$OUT/cuda_tests.log"
fi
