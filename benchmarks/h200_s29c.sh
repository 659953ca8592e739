#!/usr/bin/env bash
# Session 29, third call: where the demo pair's 8-slot synchronous lookup round goes (5.25 ms
# against 3.02 at one slot in the second call): a cProfile of the host thread, then a kernel
# trace (device busy against wall), both at 8 slots with lookup, DFlash and plain.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 220 python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain --slots 8 --lookup \
  --tokens 128 --top 45 --out "$OUT/host_demo8.json" > "$OUT/host_demo8.log" 2>&1
echo "host_demo8 exit $? $(el)"; cut -c1-170 "$OUT/host_demo8.log" | grep -v "^\s*$" | head -100
t=$(left)
timeout "$t" python3 benchmarks/gpu_timeline.py --slots 8 --loops slots-dflash,slots-plain --lookup \
  --tokens 128 --top 30 --out "$OUT/tl_demo8.json" > "$OUT/tl_demo8.log" 2>&1
echo "tl_demo8 exit $? $(el)"; grep -A40 '^==' "$OUT/tl_demo8.log" | cut -c1-150
