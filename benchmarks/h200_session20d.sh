#!/usr/bin/env bash
# H200 call 4 of session 20 (after .device/s2/install.sh): the product kernel's tests on the GPU in
# full (call 3 stopped at the dispatch test's stale count, before the CUDA tests ran).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest cuda_tests 150 -rs tests/test_kernels_matmul.py
