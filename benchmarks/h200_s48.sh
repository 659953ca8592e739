#!/usr/bin/env bash
# Session 48's device calls (after the three keep.sh calls and install.sh).
# PART=1, after the fused Gated-DeltaNet kernel reads its conv input a thread per channel
# (session 47's traces: 27 / 39 / 71 us a verify layer at 1 / 4 / 8 slots, the 24-layer replay
# 0.27 / 0.53 ms at 4 / 8): the kernel's two reads timed side by side (benchmarks/gdn_loads.py),
# the Gated-DeltaNet kernel tests on the GPU, the random 4B-shaped pair at 1, 4, 8 slots, the
# one-slot round's and plain step's traces, the four-slot round's.
# PART=2: session 47's PART=6, never run: the demo pair's bench alternating HF2Q_ROUND_WORDS
# (words in synchronous rounds and plain batched decoding), then HF2Q_HOST_PIECES, in one process.
# PART=3, after run 1 showed the channel read worth only 5 us a one-slot verify layer (27.6 ->
# 22.6) and 2 at four slots: where the kernel's time goes (benchmarks/gdn_loads.py rewritten to
# take the kernels' device times from one CUPTI trace: the two reads, probes without the
# recurrence / the conv read / the q/k norm, two candidates), then the demo pair's queue.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  timeout 150 python3 benchmarks/gdn_loads.py --batches 1,4,8 --steps 1,16 \
    --out "$OUT/gdn_loads.json" > "$OUT/gdn_loads.log" 2>&1
  echo "gdn_loads exit $? $(el)"; grep '^{' "$OUT/gdn_loads.log" | cut -c1-300
  synthetic_run syn4b 1,4,8 140
  # the one-slot round and the plain step traced in one process (what a round adds to a step)
  timeout 110 python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --slots 1 \
    --tokens 32 --top 40 --loops slots-dflash,slots-plain --out "$OUT/tl_s1.json" \
    > "$OUT/tl_s1.log" 2>&1
  echo "tl_s1 exit $? $(el)"; grep -A45 '^==' "$OUT/tl_s1.log" | cut -c1-150
  timelines "4" 60 100
  t=$(left)
  [ "$t" -gt 40 ] && gpu_pytest pytest_gdn "$t" tests/test_kernels_gated_delta.py -k cuda
  ;;
2)
  bench_values ab_words_demo 1,4,8 HF2Q_ROUND_WORDS=0,HF2Q_ROUND_WORDS=1
  bench_values ab_pieces_demo 4,8 HF2Q_HOST_PIECES=0,HF2Q_HOST_PIECES=1
  ;;
3)
  timeout 200 python3 benchmarks/gdn_loads.py --batches 1,4,8 --steps 1,16 \
    --out "$OUT/gdn_probe.json" > "$OUT/gdn_probe.log" 2>&1
  echo "gdn_probe exit $? $(el)"; grep '^{' "$OUT/gdn_probe.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['batch'], r['T'], r['bits_equal'], {k[:-3]: v for k, v in r.items() if k.endswith('_us')})"
  tail -n 3 "$OUT/gdn_probe.log" | cut -c1-300
  demo_queue_bench demo_queue
  ;;
esac
host_speed
pack_logs
