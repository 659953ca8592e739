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
node_costs node_tiled 48,64,96,128
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_matmul.py \
  -k "tiled or rows_are_bit_equal" > "$OUT/cuda_tests.log" 2>&1
echo "kernel tests exit $? $(el)"; tail -n 2 "$OUT/cuda_tests.log"
HF2Q_MM_TILED=33 timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_runtime_bf16_exact.py > "$OUT/cuda_tests_exact.log" 2>&1
echo "bf16 exact (tiled on) exit $? $(el)"; tail -n 2 "$OUT/cuda_tests_exact.log"
synthetic_variants synthetic-tiled HF2Q_MM_TILED "0 33"
# Issue 6's decode floor: products sharing an input in one launch, residual adds in the product's
# launch (HF2Q_GROUPED_MM, within noise on session 16's slow host), alternating in one process.
t=$(( ${BUDGET:-560} - ($(date +%s) - S) - 5 ))
if [ "$t" -gt 60 ]; then
  timeout "$t" python3 benchmarks/plain_ab.py --synthetic 4b --tokens 128 --runs 5 \
    --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain --out "$OUT/ab_grouped.json" \
    > "$OUT/ab_grouped.log" 2>&1
  echo "grouped A/B exit $? $(el)"; tail -n 1 "$OUT/ab_grouped.log" | cut -c1-900
fi
