#!/usr/bin/env bash
# H200 call 1 of session 21 (after .device/s2/install.sh): the product kernel's tests on the GPU
# (eight column blocks now the default at three m-tiles; thread blocks of fewer m-tiles than the
# rows, "row blocks", bit-equal to the default launch), then the launch shapes that keep the bits
# at 32-128 rows of the 4B shapes, row blocks among them.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest cuda_tests 150 -rs tests/test_kernels_matmul.py
node_tune node_tune_48_64 48,64 4b 200
t=$(left); [ "$t" -gt 60 ] && node_tune node_tune_32_128 32,128 4b "$t"
pack_logs
