#!/usr/bin/env bash
# H200 call 3 of session 20 (after .device/s2/install.sh), four column blocks at five m-tiles or
# more for every width: the CUDA tests (every row's bits whatever the launch, grouped products at
# 128 rows, bf16 DFlash == plain), the 4B-shaped pair at 1/4/6/8 slots (6: 96 verify rows, the
# launch changed by call 2's tune), issue 6's script with its per-op profile, and plain decoding
# and a DFlash round after a 1024-token prompt (one value: today's defaults).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest cuda_tests 100 -x tests/test_kernels_matmul.py
gpu_pytest cuda_tests_exact 120 -x tests/test_runtime_bf16_exact.py
synthetic_run synthetic-1468 1,4,6,8 130
ab_run plain_dflash_1024 100 --synthetic 4b --tokens 128 --runs 5 --values HF2Q_GROUPED_MM=1 \
  --modes plain,dflash
t=$(left)
[ "$t" -gt 60 ] && timeout "$t" python3 benchmarks/verify_cost.py --dtypes bf16 --paths runtime \
  --reps 9 --out "$OUT/verify_cost_profile.json" > "$OUT/verify_cost_profile.log" 2>&1
echo "verify_cost exit $? $(el)"; tail -n 45 "$OUT/verify_cost_profile.log" | cut -c1-200
pack_logs
