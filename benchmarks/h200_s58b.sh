#!/usr/bin/env bash
# The next lease's call, BUDGET=540. (Session 58's h200_s58.sh timed the column split with x
# copied ahead on an H200: 2x4x3 8.410 ms a 4-slot round against 7.974, so it is not timed here.)
# The question, from session 57 (H100, fast host):
# The one-slot round is the host's (6.07 ms against 5.62 busy) with 8 CUDA graphs a round,
#    each launch 110-167 us of host time. MLX 0.32 cuts a graph at 100 nodes or 1000 "MB" of
#    inputs on compute capability 9.0, the latter counted in elements of every input, weights
#    included (about 4e9 for a 4B verify: several graphs), and lets at most 10 graphs be in
#    flight before the host waits (MAX_ACTIVE_TASKS): with 8 a round, two lagged rounds do not
#    fit. Session 57 raised only the node limit (8 graphs -> 7, no change). Here both limits are
#    raised (MLX_MAX_OPS_PER_BUFFER=1000, MLX_MAX_MB_PER_BUFFER=100000; read once a process, so
#    one process each, alternated twice) in the goals' sweep at 1 and 4 slots, whose default
#    rows are the goals' figures; then the one-slot trace with both raised (graphs a round, the
#    idle gaps). Session 22 had raised the MB limit alone, on a round built differently: 4-slot
#    round 12.59 -> 16.42 ms.
# Then, in what is left: HF2Q_MM_SWIGLU's one-slot A/B, the lagged round's queuing settings at
# one slot, and the demo queue.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
V=HF2Q_DRAFT_VOCAB=32768
BIG="MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=100000"
for r in a b; do
  for g in default big; do
    t=$(left); [ "$t" -lt 60 ] && break 2
    [ "$t" -gt 120 ] && t=120
    settings=""; [ "$g" = big ] && settings=$BIG
    (for kv in $settings; do export "${kv?}"; done
     synthetic_run "syn4b_${g}_$r" 1,4 "$t" --draft-vocab 32768)
  done
done
(for kv in $BIG; do export "${kv?}"; done; mkdir -p "$OUT/big" && OUT="$OUT/big"
 TL_ARGS="--draft-vocab 32768" timelines 1 100 60 | cut -c1-140 | grep -E "^(==|tl_)|host CUDA API|cudaGraphLaunch")
# HF2Q_MM_SWIGLU at one slot again (session 58's host was too noisy for a verdict there)
t=$(left); [ "$t" -gt 150 ] && t=150
[ "$t" -ge 90 ] && ab_run sw_1 "$t" --synthetic 4b --slots 1 --modes plain,dflash --tokens 32 \
  --prompt-tokens 64 --runs 5 --values "$V+HF2Q_MM_SWIGLU=0,$V+HF2Q_MM_SWIGLU=1"
ab_slots lag_ "1" "$V,$V+HF2Q_LAGGED_DRAFT_FIRST=0,$V+HF2Q_LAG_DEPTH=3"
demo_queue_bench demo_queue
host_speed
pack_logs
