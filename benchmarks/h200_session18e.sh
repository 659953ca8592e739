#!/usr/bin/env bash
# H200 call (after .device/s2/install.sh): the small-M product kernel's launches of 3+ m-tiles
# compiled for two blocks per SM (HF2Q_MM_MIN_BLOCKS=2) against nvcc's own register choice:
# node_cost.py at 48, 64, 128 rows of the 4B shapes, the CUDA bit-equality test, then the random
# 4B-shaped pair at 4 and 8 slots each way (one process each, same machine).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 70 python3 benchmarks/node_cost.py --rows 48,64,128 --shapes 4b --ops 16 --reps 5 \
  --out "$OUT/node_b2.json" > "$OUT/node_b2.log" 2>&1
echo "node_cost exit $? $(el)"
grep -v '"add"' "$OUT/node_b2.log" | cut -c1-160
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_matmul.py \
  -k "two_blocks or rows_are_bit_equal" > "$OUT/cuda_tests.log" 2>&1
echo "tests exit $? $(el)"; tail -n 2 "$OUT/cuda_tests.log"
for v in 0 2; do
  t=$(( ${BUDGET:-230} - ($(date +%s) - S) - 3 ))
  [ "$t" -lt 30 ] && break
  HF2Q_MM_MIN_BLOCKS=$v timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots 4,8 \
    --gen-tokens 32 --prompt-tokens 64 --trials 2 --warmup 1 --out "$OUT/synthetic-b$v.json" \
    > "$OUT/synthetic-b$v.log" 2>&1
  echo "synthetic min_blocks=$v exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/synthetic-b$v.json" || tail -c 300 "$OUT/synthetic-b$v.log"
done
