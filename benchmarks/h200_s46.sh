#!/usr/bin/env bash
# Session 46's device calls (after the three keep.sh calls and install.sh), on the tree of session
# 45's end (the draft graph on by default on CUDA, final-state records from 32 MiB a layer, every
# layer's replay in one launch): issue 5's and 6's figures on an H200 at these defaults, which
# session 45 only measured on an H100.
# PART=1: the demo pair's queue at 1, 4, 8 slots (issue 5: 8 slots >= 1.5x plain), the random
# 4B-shaped pair at 1, 4, 8 slots (issue 5: 4 slots >= 3.2x one slot; issue 6: E at one slot),
# then two against three lagged rounds in flight (HF2Q_LAG_DEPTH) at one slot.
# PART=2: the lag-depth A/B at 4 slots, the one-slot round's kernel trace with three rounds in
# flight (are the idle gaps after the rollback and after the draft still there?), the random pair
# again (a second sample of the 4-slot / 1-slot ratio, which a slow host stretch moves).
# PART=3 (gpu_timeline.py now also reports the host's CUDA API calls, and those made while the
# device idles), after the verify graph queued as soon as it is built in lagged rounds: that
# switch's A/B at 1 and 4 slots (HF2Q_FLUSH_LAYERS=0 is the old way), the one-slot round's trace,
# the host's cProfile of that round, the four-slot round's trace, then the demo pair's 8-slot queue again.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 100 ] && synthetic_run syn4b 1,4,8 $(( t < 140 ? t : 140 ))
  ab_slots ab_depth "1" HF2Q_LAG_DEPTH=2,HF2Q_LAG_DEPTH=3 60
  ;;
2)
  ab_slots ab_depth "4" HF2Q_LAG_DEPTH=2,HF2Q_LAG_DEPTH=3 60
  HF2Q_LAG_DEPTH=3 timelines "1" 250 170
  t=$(left)
  [ "$t" -gt 80 ] && synthetic_run syn4b_2 1,4,8 $(( t < 140 ? t : 140 ))
  ;;
3)
  ab_slots ab_flush "1 4" HF2Q_FLUSH_LAYERS=0,HF2Q_FLUSH_LAYERS=8 60
  timelines "1" 100 150
  t=$(left)
  [ "$t" -gt 80 ] && timeout $(( t < 120 ? t : 120 )) python3 benchmarks/host_profile.py --synthetic 4b \
    --prompt-tokens 64 --loops slots-dflash --slots 1 --tokens 48 --top 45 --out "$OUT/host_4b1.json" \
    > "$OUT/host_4b1.log" 2>&1
  echo "host_4b1 exit $? $(el)"; grep -A 45 "== slots-dflash" "$OUT/host_4b1.log" | cut -c1-160
  timelines "4" 100 150
  demo_queue_bench demo_queue8 8
  ;;
esac
host_speed
pack_logs
