#!/usr/bin/env bash
# Ran as session 57's run 5 (BUDGET=420, at bfa4340: the weights D chunks ahead, x still one;
# results/h100/session57/README.md). The column split lost there (the round 10.33-10.49 ms
# against 9.16); x now comes D chunks ahead too (1b481b0), which h200_s58.sh times. Session 57's 4-slot trace on a
# fast H100 host had the round device-bound (8.14 ms busy of 8.14) with the MLP's gate/up at
# 56.9 us a launch against 35.8 at one slot: at 64 rows the K-split's 576 blocks each read all
# 64 rows of x from L2 (188 MB a launch against 94 MB of weights). HF2Q_MM_COLS64 forces the
# column split (x staged once a block of 64-128 columns) on launches of four m-tiles and 8192+
# columns with the weights loaded D chunks ahead (new: the split had one chunk in flight a warp,
# and lost in session 26's graph, 60.4 against 52.4 us). First its bits on the GPU, then the
# chained tune of the layouts (nvcc: 2x4x3 169 registers, 3 blocks of 4 warps an SM; 1x8x3 106,
# two of 8; 2x8x2 129, one of 8), then the 4-slot round with the settings alternating in one
# process (same tokens), then the 4-slot trace with 2x4x3.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_pytest cols64_bits 90 tests/test_kernels_matmul.py -k "cols64 or column_split"
CHAIN=1 tune_turns cols "4,8,4;2,8,1,8,1;2,8,1,4,1;2,8,1,4,3;1,8,1,8,3;2,8,1,8,2;2,8,1,8,3" 64
V=HF2Q_DRAFT_VOCAB=32768
ab_slots cols64_ "4" "$V+HF2Q_MM_COLS64=0,$V+HF2Q_MM_COLS64=2x4x3,$V+HF2Q_MM_COLS64=1x8x3,$V+HF2Q_MM_COLS64=2x8x2"
HF2Q_MM_COLS64=2x4x3 TL_ARGS="--draft-vocab 32768" timelines 4 50 | cut -c1-140 | head -30
host_speed
pack_logs
