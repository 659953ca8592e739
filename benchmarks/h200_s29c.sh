#!/usr/bin/env bash
# Session 29, third call: (1) synchronous rounds that queue their verify before waiting for their
# draft (HF2Q_QUEUE_VERIFY=1) against the default, on hf2q bench's workload (demo pair, built-in
# prompts, 4 requests a slot, 128 tokens, lookup), alternating in one process
# (benchmarks/bench_ab.py), at 8 and 1 slots (SLOTS); (2) with the time left, where the demo pair's
# 8-slot round goes: a cProfile of the host thread, then a kernel trace.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout "$(left)" python3 benchmarks/bench_ab.py --slots "${SLOTS:-8,1}" --runs 3 \
  --values HF2Q_QUEUE_VERIFY=0,HF2Q_QUEUE_VERIFY=1 --out "$OUT/ab_queue.json" > "$OUT/ab_queue.log" 2>&1
echo "ab_queue exit $? $(el)"; grep '^{"slots' "$OUT/ab_queue.log" | cut -c1-400
t=$(left)
[ "$t" -gt 40 ] && timeout "$t" python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain \
  --slots 8 --lookup --tokens 128 --top 45 --out "$OUT/host_demo8.json" > "$OUT/host_demo8.log" 2>&1
echo "host_demo8 exit $? $(el)"; cut -c1-170 "$OUT/host_demo8.log" | grep -v "^\s*$" | head -60
t=$(left)
[ "$t" -gt 40 ] && timeout "$t" python3 benchmarks/gpu_timeline.py --slots 8 --loops slots-dflash,slots-plain \
  --lookup --tokens 128 --top 30 --out "$OUT/tl_demo8.json" > "$OUT/tl_demo8.log" 2>&1
echo "tl_demo8 exit $? $(el)"; grep -A40 '^==' "$OUT/tl_demo8.log" | cut -c1-150
