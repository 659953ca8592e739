#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): the final tree of session 16 (every verify row on
# the small-M kernel by default, wider launches for 3-8 m-tiles): the kernel's CUDA tests, the
# 4B-shaped pair at 1, 4 and 8 slots, greedy DFlash == plain in bf16.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 130 python3 -m pytest -q tests/test_kernels_matmul.py -k cuda > "$OUT/tests_matmul.log" 2>&1
echo "matmul tests exit $? $(el)"; tail -n 3 "$OUT/tests_matmul.log"
timeout 170 python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4,8 --gen-tokens 32 \
  --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/slots4b.json" > "$OUT/slots4b.log" 2>&1
echo "slots_synthetic exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/slots4b.json" || tail -c 600 "$OUT/slots4b.log"
t=$(( ${BUDGET:-340} - ($(date +%s) - S) ))
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m pytest -q -x tests/test_runtime_bf16_exact.py > "$OUT/tests_bf16.log" 2>&1
  echo "bf16 tests exit $? $(el)"; tail -n 3 "$OUT/tests_bf16.log"
fi
