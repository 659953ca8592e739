#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh) measuring the embedded demo pair:
# 1. step_trace.py: plain vs DFlash step/round times in one process (first run = JIT warm-up).
# 2. hf2q bench --slots $SLOTS (default 1,2,4,8) once per value of RPS (requests per slot,
#    default "1"; e.g. RPS="1 4" also measures a queue of 4 x N requests on N slots) and per
#    value of LOOKUPS (default "lookup", hf2q's default; LOOKUPS="lookup no-lookup" measures
#    DFlash with and without lookup drafts back to back).
# 3. CUDA tests ($TESTS, default the kernel attention/layers files; TESTS=none skips them) in the
#    time left.
# TRACE=0 skips step 1; NODES=1 first counts graph nodes per step (benchmarks/graph_nodes.py) at
# 8 slots and for one sequence.
# Used on 2026-11-30 (as h200_session10.sh, RPS=1): benchmarks/results/h200/demo-pair-2026-11-30/.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0
S=$(date +%s)
left() { echo $(( ${BUDGET:-440} - ($(date +%s) - S) )); }
if [ "${NODES:-0}" = 1 ]; then
  for n in 8 0; do
    timeout 120 python3 benchmarks/graph_nodes.py --slots $n --gen-tokens 32 --out "$OUT/nodes$n.json" \
      > "$OUT/nodes$n.log" 2>&1
    echo "nodes slots=$n exit $? [$(( $(date +%s) - S ))s]"
    grep -v '^{' "$OUT/nodes$n.log" | cut -c1-240
  done
fi
[ "${TRACE:-1}" = 1 ] && timeout 120 python3 benchmarks/step_trace.py --tokens 256 --repeats 2 --out "$OUT/trace_bucket.json" \
  > "$OUT/trace_bucket.log" 2>&1
[ "${TRACE:-1}" = 1 ] && { echo "trace exit $? [$(( $(date +%s) - S ))s]"; cut -c1-330 "$OUT/trace_bucket.log"; }
for k in ${RPS:-1}; do
for lk in ${LOOKUPS:-lookup}; do
  f="$OUT/slots-demo-rps$k-$lk"
  timeout "${BENCH_S:-240}" python3 -m hf2q bench --slots "${SLOTS:-1,2,4,8}" --requests-per-slot "$k" \
    --"$lk" --gen-tokens 128 --trials 3 --warmup 1 --json --out "$f.json" > "$f.log" 2>&1
  echo "bench rps $k $lk exit $? [$(( $(date +%s) - S ))s]"
  python3 benchmarks/bench_rows.py "$f.json" || tail -c 600 "$f.log"
done
done
t=$(left)
# shellcheck disable=SC2086  # TESTS is a list of paths
[ "${TESTS:-}" != none ] && [ "$t" -gt 20 ] && timeout "$t" python3 -m pytest -q -x \
  ${TESTS:-tests/test_kernels_attention.py tests/test_kernels_layers.py} > "$OUT/cuda_tests.log" 2>&1
echo "tests exit $? [$(( $(date +%s) - S ))s]"
tail -n 3 "$OUT/cuda_tests.log"
