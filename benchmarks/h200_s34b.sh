#!/usr/bin/env bash
# Session 34, after the dequantizing small-M kernel (hf2q/kernels/cuda_matmul.py,
# small_qmatmul_cuda): PART=tests runs its CUDA tests with the unquantized kernel's and the bf16
# exactness tests, then times it against MLX's quantized products (quant_rows.py --kernel);
# PART=runs times the random 4B-shaped pair with a 4-bit target with the kernel off and on
# (plain_ab.py, alternating in one process) and runs slots_synthetic.py with it (DFlash tokens
# against plain decoding's, E, 4 slots / 1 slot).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
if [ "${PART:-tests}" = tests ]; then
  gpu_pytest qtests 330 tests/test_kernels_qmatmul.py tests/test_runtime_bf16_exact.py \
    tests/test_kernels_matmul.py
  t=$(left)
  timeout "$t" python3 benchmarks/quant_rows.py --shapes 4b --bits 4,8 --rows 1,16,64 --kernel \
    --out "$OUT/quant_rows_kernel.json" > "$OUT/quant_rows_kernel.log" 2>&1
  echo "quant_rows exit $? $(el)"; cut -c1-220 "$OUT/quant_rows_kernel.log"
else
  ab_run ab_q4 240 --synthetic 4b --target-bits 4 --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 3 --env HF2Q_SMALL_QMM --values HF2Q_SMALL_QMM=0,HF2Q_SMALL_QMM=1
  t=$(left)
  [ "$t" -gt 60 ] && timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4 \
    --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --target-bits 4 \
    --out "$OUT/syn4b_t4k.json" > "$OUT/syn4b_t4k.log" 2>&1
  echo "syn4b_t4k exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/syn4b_t4k.json" || tail -c 300 "$OUT/syn4b_t4k.log"
fi
host_speed
pack_logs
