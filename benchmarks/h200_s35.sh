#!/usr/bin/env bash
# Session 35. PART=tests: the dequantizing kernel's CUDA tests again (its Hf2qDeq header changed
# after session 34's GPU run) and the CUDA tests of test_kernels_matmul.py that session 34's run was
# cut before; then, in what remains, the random 4B-shaped pair with a 4-bit target and a 4-bit
# drafter (slots_synthetic.py --draft-bits 4: the drafter's quantized layers on the same kernel).
# The launch shapes of the dequantizing kernel are h200_s34c.sh's (run it as is).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
M=tests/test_kernels_matmul.py
gpu_pytest qtests 330 tests/test_kernels_qmatmul.py \
  "$M::test_cuda_column_split_has_the_k_splits_bits[128]" \
  "$M::test_cuda_residual_in_the_launch_has_the_bits_of_mlx_add" \
  "$M::test_cuda_drafts_of_many_rows_run_mlx_matmul" \
  "$M::test_cuda_runners_give_the_same_logits_with_grouped_products" \
  "$M::test_cuda_demo_target_through_the_kernel_matches_mlx" \
  "$M::test_runners_with_the_dispatch_leave_what_it_cannot_run_alone"
t=$(left)
[ "$t" -gt 60 ] && timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4 \
  --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --target-bits 4 --draft-bits 4 \
  --out "$OUT/syn4b_t4d4.json" > "$OUT/syn4b_t4d4.log" 2>&1
echo "syn4b_t4d4 exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/syn4b_t4d4.json" || tail -c 300 "$OUT/syn4b_t4d4.log"
host_speed
pack_logs
