#!/usr/bin/env bash
# Session 26, after the stage calls: the small-M kernel's column-split layout (HF2Q_MM_COLUMNS,
# off by default until this run): (1) its GPU tests (bits equal to the K-split's, grouped, with a
# residual); (2) the 4B shapes and the tied head at 48, 64 and 128 rows, the launches timed in
# turn: the K-split's default against the column split at one and two 8-column blocks a warp
# (and, at 48 rows, the K-split with four blocks unrolled: three slots' 2560-column products run
# 40 blocks of eight); (3) the 4B-shaped pair's DFlash rounds at 4 and 8 slots with the switch
# off / on alternating in one process (at 4 slots also on with the drafter's 64-row products on
# the kernel instead of cuBLAS, HF2Q_DRAFT_MM_ROWS=128); (4) the bf16 exactness tests with the switch on; (5) the
# pair at 1-4 slots with it on.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
gpu_pytest t_cols 120 tests/test_kernels_matmul.py -m "not slow" -k "column or rows_are_bit_equal or grouped_kernel"
SHAPES=4b,head4b tune_turns cols "4,8,4;8,8,1;2,8,1,8;1,8,1,8" 48 64 128
ab_run cols_s4 120 --synthetic 4b --slots 4 --modes dflash --tokens 32 --prompt-tokens 64 --runs 5 \
  --values HF2Q_MM_COLUMNS=0,HF2Q_MM_COLUMNS=1,HF2Q_MM_COLUMNS=1+HF2Q_DRAFT_MM_ROWS=128
t=$(left); [ "$t" -gt 200 ] && ab_run cols_s8 100 --synthetic 4b --slots 8 --modes dflash --tokens 32 \
  --prompt-tokens 64 --runs 3 --values HF2Q_MM_COLUMNS=0,HF2Q_MM_COLUMNS=1
export HF2Q_MM_COLUMNS=1
t=$(left); [ "$t" -gt 100 ] && gpu_pytest t_exact 90 tests/test_runtime_bf16_exact.py -m "not slow" -k "exact"
t=$(left); [ "$t" -gt 100 ] && synthetic_run synthetic_cols 1,2,3,4 "$(( t - 10 ))"
unset HF2Q_MM_COLUMNS
pack_logs
