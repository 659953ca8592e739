#!/usr/bin/env bash
# Session 26, second call: after h200_s26.sh found the column split faster on the head and the
# gate/up shapes at 48-64 rows in isolation but not at 128 (column_shape now stops at four
# m-tiles) and the drafter's 64-row products faster on the kernel than on cuBLAS except its head
# (HF2Q_DRAFT_HEAD_MM_ROWS, new): (1) the 4B-shaped pair's 4-slot DFlash rounds with the four
# combinations alternating in one process; (2) kernel traces of the 4-slot round with both off
# and both on (device time per kernel, whatever the host); (3) the pair at 1-4 slots with both on.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
DRAFT=HF2Q_DRAFT_MM_ROWS=64+HF2Q_DRAFT_HEAD_MM_ROWS=32
ab_run s4 200 --synthetic 4b --slots 4 --modes dflash --tokens 32 --prompt-tokens 64 --runs 5 \
  --values "HF2Q_MM_COLUMNS=0,HF2Q_MM_COLUMNS=1,HF2Q_MM_COLUMNS=1+$DRAFT,$DRAFT"
trace() {  # trace NAME: the 4-slot round under the profiler, with the environment as it is
  timeout 80 python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --slots 4 \
    --tokens 32 --top 40 --sequence 2500 --loops slots-dflash --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? $(el)"; grep -A22 '^==' "$OUT/$1.log" | cut -c1-150
}
trace tl_off
export HF2Q_MM_COLUMNS=1 HF2Q_DRAFT_MM_ROWS=64 HF2Q_DRAFT_HEAD_MM_ROWS=32
trace tl_on
t=$(left); [ "$t" -gt 90 ] && synthetic_run synthetic_on 1,2,3,4 "$(( t - 10 ))"
pack_logs
