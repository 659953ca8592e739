#!/usr/bin/env bash
# Ran as session 56's run 1 (an H100; benchmarks/results/h100/session56/); the next call is now
# h200_s56.sh. Session 55 (an H100) traced the 4-slot round of the 4B-shaped pair: all device time, and the
# layers' products take 1.73 ms more at 64 rows than at 16 for the same weights. On an H200 (the
# goals' machine, none lent since session 44) this call first runs the goals' figures at today's
# defaults with 32768 draft ids: the random pair's slot sweep (E, 4 slots against one). Then it
# tunes the column-split launches narrower than the heads' (2 or 4 column warps: x staged once for
# 64 columns, 144-288 blocks) against the K-split at 16 and 64 rows. That says whether the input's
# L2 traffic (two input rows read per weight row at 64 rows) is what the 64-row products lose to.
# Then the demo pair's queue at 1, 4 and 8 slots (issue 5's 8-slot goal). Last, in what is left,
# the random pair at 1 and 4 slots with MLX's CUDA graphs of up to 400 and 200 kernels instead of
# 100 (MLX reads the setting at start-up, so one process each): the one-slot trace's idle time is
# the host launching graphs (0.83 ms of cudaGraphLaunch a round), and fewer, larger graphs cost
# the host less (the demo pair lost with 400 in session 11, but its rounds are a fifth as long).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
synthetic_run syn4b_v32k 1,4,8 150 --draft-vocab 32768
tune_turns cols "4,8,4;8,8,1;2,8,1,8;2,8,1,4;4,8,1,2;1,8,1,8;4,8,1,4" 64 16
demo_queue_bench demo_queue
for v in 400 200; do
  t=$(left); [ "$t" -lt 60 ] && break
  (export MLX_MAX_OPS_PER_BUFFER=$v; synthetic_run "syn4b_ops$v" 1,4 "$t" --draft-vocab 32768)
done
host_speed
pack_logs
