#!/usr/bin/env bash
# H200 call 4 of session 21 (after .device/s2/install.sh): eight column blocks unrolled 4 times at
# two m-tiles (call 3's fairer tune): the kernel's CUDA tests (a row's bits at 1-96 rows), the
# 4B-shaped pair at 1, 2, 3, 4 and 8 slots, the demo pair with a queue (issue 5's runs), then the
# bf16 DFlash-equals-plain tests.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest cuda_tests 120 -rs tests/test_kernels_matmul.py -k cuda
synthetic_run synthetic 1,2,3,4,8 200
demo_queue_bench demo-rps4
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest bf16_exact "$t" tests/test_runtime_bf16_exact.py
pack_logs
