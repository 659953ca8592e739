#!/usr/bin/env bash
# Session 23, call 2 (after .device/s2/install.sh): issue 5's and 6's runs with session 22's
# lagged-round defaults (draft queued first, verify every 8 layers). First E in one process: plain
# decode steps and DFlash rounds of the random 4B-shaped pair at one slot, alternating (one value,
# the defaults), then the pair at 1-8 slots, the demo pair's 8-slot rounds with lagged lookup
# rounds or the verify queued every 4 layers (alternating in one process), and the demo pair with
# a queue.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
ab_run e_one_slot 150 --synthetic 4b --slots 1 --modes plain,dflash --tokens 32 --prompt-tokens 64 \
  --runs 5 --values "HF2Q_GDN_RECORD=states,HF2Q_GDN_RECORD=final"
synthetic_run synthetic 1,2,3,4,8 "$(left)"
# The demo pair's 8-slot rounds (lookup drafts, synchronous): lagged lookup rounds and the verify
# queued every 4 layers (of its 8), now that lagged rounds queue their draft and verify early.
t=$(left)
[ "$t" -gt 60 ] && ab_run demo8 "$t" --demo --lookup --slots 8 --modes plain,dflash --tokens 128 \
  --runs 3 --values "HF2Q_LAGGED_LOOKUP=0,HF2Q_LAGGED_LOOKUP=1,HF2Q_FLUSH_LAYERS=4"
demo_queue_bench demo-rps4
pack_logs
