#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): where in a batched DFlash round does the device
# wait? Session 22's first traces (h200_timeline.sh) found the random 4B-shaped pair's round at 4
# slots 12.9 ms of wall with the device busy 9.0 ms and ~3.4 idle gaps of >= 50 us (3.4 ms).
# gpu_timeline.py (one process per setting: the profiler crashed when a process started a third
# trace) at 4 slots and 1 slot with the kernel sequence kept, then at 4 slots with MLX's graphs
# cut by op count only (MLX_MAX_MB_PER_BUFFER=100000: every input's bytes, weights included, count
# toward 1000 MB a graph on an H200, and eval waits when more than 10 graphs are in flight) and
# with synchronous rounds (HF2Q_LAGGED_ROUNDS=0).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
trace() {  # NAME SLOTS SEQ [ENV=VALUE...]
  local name=$1 slots=$2 seq=$3 t
  shift 3
  t=$(left); [ "$t" -lt 40 ] && return
  [ "$t" -gt 90 ] && t=90
  env "$@" timeout "$t" python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 \
    --slots "$slots" --tokens 32 --top 30 --sequence "$seq" --loops slots-dflash \
    --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; grep -A42 '^==' "$OUT/$name.log" | cut -c1-150
}
trace tl_s4 4 2500
trace tl_s1 1 1500
trace tl_s4_mb 4 2500 MLX_MAX_MB_PER_BUFFER=100000
trace tl_s4_sync 4 2500 HF2Q_LAGGED_ROUNDS=0
pack_logs
