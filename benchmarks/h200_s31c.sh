#!/usr/bin/env bash
# Session 31, third call, drafts queued ahead on by default on CUDA. (1) hf2q bench on the demo
# pair at 1, 4, 8 slots again (issue 5's 8-slot goal: 1.53x in run 2; one run is one host);
# (2) a kernel trace of the demo pair's 8-slot round with lookup (session 30: wall 5.15 ms,
# device busy 1.75, the largest idle gap 0.9-1.4 ms where the next draft was built after the
# read); (3) the lookup tests on the GPU (synchronous rounds now draft ahead there by default).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
demo_queue_bench demo_queue
t=$(left)
[ "$t" -gt 60 ] && timeout $(( t < 110 ? t : 110 )) python3 benchmarks/gpu_timeline.py --slots 8 \
  --loops slots-dflash,slots-plain --lookup --tokens 128 --top 40 --out "$OUT/tl_demo8.json" \
  > "$OUT/tl_demo8.log" 2>&1
echo "tl_demo8 exit $? $(el)"; grep -A45 '^==' "$OUT/tl_demo8.log" | cut -c1-150
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest gpu_lookup "$t" tests/test_runtime_lookup.py
host_speed
pack_logs
