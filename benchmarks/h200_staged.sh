#!/usr/bin/env bash
# Session 22, run 1 (after .device/s2/install.sh), at commit 6962456: weights staged through
# shared memory with cp.async (cuda_matmul's tune, fourth value: chunks in flight), the
# candidate for the 64-row products that bind issue 5's 4-slot round (37.7 us for 2560 x 9216
# against a 9.8 us weight-read floor, session 21 run 3). First the kernel's CUDA tests (staged
# launches bit-equal to the default at 16, 64 and 128 rows), then the launches timed in turn.
# Staged launches were slower at every row count and the option was removed afterwards: this
# script records that call and runs only at that commit.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest cuda_tests 120 tests/test_kernels_matmul.py -k cuda
C="4,8,4;4,8,1;4,8,1,2;4,8,1,3;4,8,1,4;4,8,2,2;4,8,2,3;4,8,2,4;8,8,1,2;8,8,4,2"
tune_turns staged "$C" 64,48 128,32,16
pack_logs
