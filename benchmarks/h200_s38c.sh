#!/usr/bin/env bash
# Session 38, third call: the compiled decode step on by default on CUDA where its bits are the
# layer path's (CompiledDecode.exact). (1) the GPU tests with the new default: the compiled step
# against the layer path bit for bit on the demo target, greedy DFlash = plain decoding in bf16
# (fidelity, bf16 exactness, the 4-bit demo target); (2) the 4-bit 4B-shaped target's plain steps
# after 1024 prompt tokens, the switch off / on alternating in one process.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
gpu_pytest pytest_default 300 tests/test_kernels_forward.py tests/test_runtime_bf16_exact.py \
  tests/test_runtime_fidelity.py \
  "tests/test_kernels_qmatmul.py::test_cuda_greedy_dflash_on_a_quantized_target_equals_plain"
t=$(left)
[ "$t" -gt 60 ] && ab_run ab4_cf1024 "$t" --synthetic 4b --target-bits 4 --modes plain,dflash \
  --tokens 64 --prompt-tokens 1024 --runs 5 --env HF2Q_COMPILE_FORWARD --values 0,1
host_speed
pack_logs
