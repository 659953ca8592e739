#!/usr/bin/env bash
# The next lease's first call (after the three keep.sh calls and install.sh), with BUDGET=540.
# Session 56 ran on an H100 with a slow host (1.1-1.45 s for 1e7 Python adds), where the one-slot
# round was the host's (8.79 ms against 6.11 on session 55's host). This call first tunes the
# 64- and 16-row launches with chained products (benchmarks/node_cost.py --chain) and times the
# 4-slot round with HF2Q_MM_TILES64's narrower 64-row launches alternating in one process (new
# information first, in case the machine is taken back). Then it repeats the goals' figures at
# today's defaults: the random pair's slot sweep with 32768 draft ids (E and 4 slots against one;
# on an H200 the goals' machine, none lent since session 44) and the demo pair's queue (issue 5's
# 8-slot goal), with the host's speed before and after. Then, in what is left, the one-slot
# round's kernel trace, to place its idle time again on this machine.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
# Whether a chained tune (each product adds the one before, as in a forward) ranks the 64-row
# launches as the round did: session 56's column split (4, 8, 1, 4) lost there (gate/up 61.8 us
# a launch against 57.6, the 2560-wide products 144 against 32) but won the independent tune.
# With it the K-split's narrower blocks: nvcc gives the default (4 blocks unrolled 4 times) 254
# registers at 64 rows, one 8-warp block an SM (80 blocks for a 2560-wide product on 132 SMs);
# 2 blocks 130-142, 1 block 78 (three blocks an SM) or 112 unrolled 4 times. Narrower blocks
# read the input more often (each block reads all 64 rows: 188 MB from L2 for gate and up at
# 4 blocks, 377 at 2, 755 at 1, against 94 MB of weights), so the tune decides.
CHAIN=1 tune_turns chain "4,8,4;4,8,1;2,8,1;2,8,4;1,8,1;1,8,4;4,8,1,4" 64 16
# The same launches in the 4-slot round, alternating in one process (the same bits).
V=HF2Q_DRAFT_VOCAB=32768
ab_slots tiles64_ "4" "$V+HF2Q_MM_TILES64=0,$V+HF2Q_MM_TILES64=2x1,$V+HF2Q_MM_TILES64=2x4,$V+HF2Q_MM_TILES64=1x1"
synthetic_run syn4b_v32k 1,4,8 150 --draft-vocab 32768
demo_queue_bench demo_queue
TL_ARGS="--draft-vocab 32768" timelines 1 60
host_speed
pack_logs
