#!/usr/bin/env bash
# Session 47's device calls (after the three keep.sh calls and install.sh), on the tree of session
# 46's end (lagged rounds queue the verify graph as soon as it is built; gpu_timeline.py also
# reports the host's CUDA API calls).
# PART=1: issue 5's and 6's figures at these defaults: the demo pair's queue at 1, 4, 8 slots
# (8 slots >= 1.5x plain), the random 4B-shaped pair at 1, 4, 8 slots (4 slots >= 3.2x one slot;
# E at one slot), then the one-slot round's trace with the host's API calls (where does the host
# wait while the device idles after the draft?).
# PART=2: the host's cProfile of the one-slot round, the four-slot round's trace, the random pair
# again (a second sample of the 4-slot / 1-slot ratio, which a slow host stretch moves).
# PART=3, after lagged rounds read their outcome as 8-byte words (HF2Q_ROUND_WORDS; run 1's trace
# had the drafts' synchronous copy holding the host 1.38 ms a round): that switch's A/B at 1 and
# 4 slots, the random pair at 1, 4, 8 slots, the one-slot trace, the readback tests on the GPU.
# PART=4: the demo pair's queue at 1, 4, 8 slots, the four- and eight-slot traces (run 3's one-slot
# trace has the device busy for all but 0.03 ms of the round: are more slots host-bound?).
# PART=5, after greedy rounds make each list of draft limits into an array once (run 4's 4- and
# 8-slot traces still had a synchronous cudaMemcpy most rounds: a new host array of more than 8
# bytes given a freed device buffer): the random pair at 1, 4, 8 slots, the 4- and 8-slot traces,
# the demo pair's queue.
# PART=6 and PART=7 (not run in session 47: its device time was spent), after synchronous rounds
# and plain batched decoding read words too and small host-made arrays are joined from 8-byte
# pieces. 6: the demo pair's bench alternating HF2Q_ROUND_WORDS, then HF2Q_HOST_PIECES, in one
# process. 7: the random pair at 1, 4, 8 slots, the demo pair's 8-slot trace (any cudaMemcpy left
# in its synchronous rounds?), the random pair's 4-slot trace.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 100 ] && synthetic_run syn4b 1,4,8 $(( t < 140 ? t : 140 ))
  timelines "1" 100 150
  ;;
2)
  t=$(left)
  [ "$t" -gt 80 ] && timeout $(( t < 120 ? t : 120 )) python3 benchmarks/host_profile.py --synthetic 4b \
    --prompt-tokens 64 --loops slots-dflash --slots 1 --tokens 48 --top 45 --out "$OUT/host_4b1.json" \
    > "$OUT/host_4b1.log" 2>&1
  echo "host_4b1 exit $? $(el)"; grep -A 45 "== slots-dflash" "$OUT/host_4b1.log" | cut -c1-160
  timelines "4" 100 150
  t=$(left)
  [ "$t" -gt 80 ] && synthetic_run syn4b_2 1,4,8 $(( t < 140 ? t : 140 ))
  ;;
3)
  ab_slots ab_words "1 4" HF2Q_ROUND_WORDS=0,HF2Q_ROUND_WORDS=1 60
  t=$(left)
  [ "$t" -gt 80 ] && synthetic_run syn4b_w 1,4,8 $(( t < 140 ? t : 140 ))
  timelines "1" 60 100
  t=$(left)
  [ "$t" -gt 30 ] && gpu_pytest pytest_words "$t" tests/test_kernels_readback.py
  ;;
4)
  demo_queue_bench demo_queue_w
  timelines "4 8" 60 100
  ;;
5)
  synthetic_run syn4b_l 1,4,8 140
  timelines "4 8" 60 100
  demo_queue_bench demo_queue_l
  ;;
6)
  bench_values ab_words_demo 1,4,8 HF2Q_ROUND_WORDS=0,HF2Q_ROUND_WORDS=1
  bench_values ab_pieces_demo 4,8 HF2Q_HOST_PIECES=0,HF2Q_HOST_PIECES=1
  ;;
7)
  synthetic_run syn4b_7 1,4,8 140
  demo_timeline tl_demo8 60
  timelines "4" 60 100
  ;;
esac
host_speed
pack_logs
