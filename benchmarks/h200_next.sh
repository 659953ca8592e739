#!/usr/bin/env bash
# For the next H200 call (after the three stage calls; not yet run). What session 25 left open:
# (1) a lagged 1-slot round's key/value writes by scatter against the slice update at a device
# offset (HF2Q_KV_ROW_SCATTER, off; 36 dynamic copies of 12 us median a round in run 1's trace),
# alternating in one process; (2) why the round grows most from two slots to three (sessions 21,
# 22, 24, 25: 8.3 -> 10.4 ms in run 3) - traces of the window tree at 2 and 3 slots; (3) the
# 4B-shaped pair at 1-4 slots, trials round-robin (session 26: the 2-slot trace and the demo
# bench went to a call of their own, 560 s did not hold them all).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest t_cuda 60 tests/test_slots_isolation.py -m "not slow" -k "lagged"
ab_run kv_s1 90 --synthetic 4b --slots 1 --modes dflash --tokens 32 --prompt-tokens 64 --runs 5 \
  --values HF2Q_KV_ROW_SCATTER=0,HF2Q_KV_ROW_SCATTER=1
# (3 slots keep per-step states: 96 MiB a layer, under GDN_FINAL_MIN_BYTES; the final state was
# timed at 2, 4 and 8 slots only, session 23)
ab_run rec_s3 90 --synthetic 4b --slots 3 --modes dflash --tokens 32 --prompt-tokens 64 --runs 5 \
  --values HF2Q_GDN_RECORD=states,HF2Q_GDN_RECORD=final
timelines "3" 200
t=$(left); [ "$t" -gt 100 ] && synthetic_run synthetic 1,2,3,4 90
pack_logs
