#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): is a batched DFlash round waiting on the host or on
# the device, and what does the device run? benchmarks/gpu_timeline.py traces every kernel of the
# steady-state rounds (CUPTI, through torch's profiler) of the random 4B-shaped pair at 1, 2, 3,
# 4 and 8 slots (DFlash and plain batched), then of the demo pair at 1 and 8 slots (lookup on, as
# the CLI; NO_DEMO=1 skips it), and reports per round: wall, device busy, kernel count, idle gaps, the top kernels.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
t=$(left)
timeout "$t" python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --slots 1,2,3,4,8 \
  --tokens 32 --out "$OUT/timeline_4b.json" > "$OUT/timeline_4b.log" 2>&1
echo "timeline_4b exit $? $(el)"; grep -A12 '^==' "$OUT/timeline_4b.log" | cut -c1-150
t=$(left)
[ "$t" -gt 60 ] && [ -z "${NO_DEMO:-}" ] && {
  timeout "$t" python3 benchmarks/gpu_timeline.py --slots 1,8 --tokens 128 --lookup \
    --out "$OUT/timeline_demo.json" > "$OUT/timeline_demo.log" 2>&1
  echo "timeline_demo exit $? $(el)"; grep -A8 '^==' "$OUT/timeline_demo.log" | cut -c1-150
}
pack_logs
