#!/usr/bin/env bash
# Next H200 call (after .device/s2/install.sh): the many-row layout of the product kernel
# (HF2Q_MM_TILED=1, hf2q/kernels/cuda_tiled_mm.py, written without a GPU in session 18).
# node_cost.py times it against the small-M kernel and cuBLAS at 48-128 rows of the 4B shapes;
# the CUDA tests check its bits (and bf16 DFlash against plain decoding with it on); then the
# random 4B-shaped pair at 1, 4, 8 slots with it off and on from 33 rows (HF2Q_MM_TILED=33: the
# 4-slot verify's 64 rows too), one process each, same machine.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 100 python3 benchmarks/node_cost.py --rows 48,64,96,128 --shapes 4b --ops 16 --reps 5 \
  --out "$OUT/node_tiled.json" > "$OUT/node_tiled.log" 2>&1
echo "node_cost exit $? $(el)"
grep -v '"add"' "$OUT/node_tiled.log" | cut -c1-150
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_matmul.py \
  -k "tiled or rows_are_bit_equal" > "$OUT/cuda_tests.log" 2>&1
echo "kernel tests exit $? $(el)"; tail -n 2 "$OUT/cuda_tests.log"
HF2Q_MM_TILED=33 timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_runtime_bf16_exact.py > "$OUT/cuda_tests_exact.log" 2>&1
echo "bf16 exact (tiled on) exit $? $(el)"; tail -n 2 "$OUT/cuda_tests_exact.log"
for v in 0 33; do
  t=$(( ${BUDGET:-560} - ($(date +%s) - S) - 5 ))
  [ "$t" -lt 40 ] && break
  HF2Q_MM_TILED=$v timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4,8 \
    --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/synthetic-tiled$v.json" \
    > "$OUT/synthetic-tiled$v.log" 2>&1
  echo "synthetic tiled=$v exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/synthetic-tiled$v.json" || tail -c 300 "$OUT/synthetic-tiled$v.log"
done
# Issue 6's decode floor: products sharing an input in one launch, residual adds in the product's
# launch (HF2Q_GROUPED_MM, within noise on session 16's slow host), alternating in one process.
t=$(( ${BUDGET:-560} - ($(date +%s) - S) - 5 ))
if [ "$t" -gt 60 ]; then
  timeout "$t" python3 benchmarks/plain_ab.py --synthetic 4b --tokens 128 --runs 5 \
    --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain --out "$OUT/ab_grouped.json" \
    > "$OUT/ab_grouped.log" 2>&1
  echo "grouped A/B exit $? $(el)"; tail -n 1 "$OUT/ab_grouped.log" | cut -c1-900
fi
