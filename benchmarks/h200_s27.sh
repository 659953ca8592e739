#!/usr/bin/env bash
# Session 27, first call (after the three stage calls), on session 26's final defaults:
# (1) the host's speed (sessions 26's hosts ran a Python loop of 1e7 adds in 0.90-1.41 s and the
# rounds were host-bound); (2) a lagged 1-slot round's key/value writes by scatter against the
# slice update at a device offset (HF2Q_KV_ROW_SCATTER; 36 dynamic copies, 0.52 ms of a 6.1 ms busy
# round in session 25's 1-slot trace), alternating in one process, with the warm-up room session
# 26's run 1 lacked; (3) the 4B-shaped pair at 1-4 slots; (4) the demo pair with a queue.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
ab_run kv_s1 170 --synthetic 4b --slots 1 --modes dflash --tokens 32 --prompt-tokens 64 --runs 5 \
  --values HF2Q_KV_ROW_SCATTER=0,HF2Q_KV_ROW_SCATTER=1
synthetic_run synthetic 1,2,3,4 170
demo_queue_bench demo
pack_logs
