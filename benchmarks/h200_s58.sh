#!/usr/bin/env bash
# The next lease's first call (after the three keep.sh calls and install.sh), with BUDGET=540.
# Session 57 (H100, fast host) measured the 4-slot round device-bound (8.14 ms busy of 8.14),
# the MLP's gate/up at 56.9 us a launch against 35.8 at one slot: at 64 rows the K-split's
# blocks each read all 64 rows of x from L2. The column split (x staged once a block) lost in
# run 5 with only the weights loaded ahead (gate/up 88.7 us, round 10.33-10.49 ms against 9.16,
# same tokens). Since 1b481b0 x is copied D chunks ahead too (cp.async), so each warp no longer
# waits for x's next chunk at every one of its K/64 barriers. First the layouts' bits on this
# GPU, then the 4-slot round with HF2Q_MM_COLS64 off and three layouts alternating in one
# process (nvcc: 2x4x3 128 registers and 62 KB shared, three 4-warp blocks an SM; 2x4x2 124
# and 53 KB, four; 1x8x3 101 and 62 KB, two 8-warp blocks), then the 4-slot trace with 2x4x3 (the products' own
# times), then the goals' figures: the random pair's 1- and 4-slot sweep (E, 4 slots against
# one) and the demo queue (8 slots against plain decoding). Last, in what is left: the one-slot
# round is the host's on a fast host too (session 57: 6.07 ms against 5.62 busy, the device idle
# 0.79 ms between the draft and the verify), so the lagged round's queuing settings alternate
# there: the default (draft queued first, two rounds in flight), the draft queued with the
# verify, and three rounds in flight.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_pytest cols64_bits 60 tests/test_kernels_matmul.py -k "cuda_cols64 or cuda_column_split"
V=HF2Q_DRAFT_VOCAB=32768
ab_slots cols64_ "4" "$V+HF2Q_MM_COLS64=0,$V+HF2Q_MM_COLS64=2x4x3,$V+HF2Q_MM_COLS64=2x4x2,$V+HF2Q_MM_COLS64=1x8x3"
HF2Q_MM_COLS64=2x4x3 TL_ARGS="--draft-vocab 32768" timelines 4 200 60 | cut -c1-140 | head -24
synthetic_run syn4b_v32k 1,4 $(( $(left) > 150 ? 150 : $(left) )) --draft-vocab 32768
demo_queue_bench demo_queue
ab_slots lag_ "1" "$V,$V+HF2Q_LAGGED_DRAFT_FIRST=0,$V+HF2Q_LAG_DEPTH=3"
host_speed
pack_logs
