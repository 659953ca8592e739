#!/usr/bin/env bash
# Session 38, first call: is the plain decode step at issue 6's 1024-token context bound by the
# host or the device, and does the whole step as one compiled graph (HF2Q_COMPILE_FORWARD=1) bring
# it nearer the bandwidth floor now that the kernels are faster than in session 16 (its last A/B)?
# (1) plain_ab.py, plain and DFlash loops after a 1024-token prompt, the switch off / on
# alternating in one process; (2) forward_build.py, the host's graph-building time both ways;
# (3) kernel traces (gpu_timeline.py, one process each) of plain steps at 1024 positions with the
# switch off and on, and of DFlash rounds at 1024: device busy against wall.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
ab_run ab_cf1024 200 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 1024 --runs 5 \
  --env HF2Q_COMPILE_FORWARD --values 0,1
timeout 100 python3 benchmarks/forward_build.py --synthetic 4b --reps 50 --out "$OUT/build.json" \
  > "$OUT/build.log" 2>&1
echo "forward_build exit $? $(el)"; tail -n 3 "$OUT/build.log" | cut -c1-600
for v in 0 1; do
  t=$(left); [ "$t" -lt 70 ] && break
  HF2Q_COMPILE_FORWARD=$v timeout $(( t < 100 ? t : 100 )) python3 benchmarks/gpu_timeline.py \
    --synthetic 4b --prompt-tokens 1024 --loops plain --slots 1 --tokens 48 --top 25 \
    --out "$OUT/tl_plain1024_cf$v.json" > "$OUT/tl_plain1024_cf$v.log" 2>&1
  echo "tl_plain1024_cf$v exit $? $(el)"; grep -A30 '^==' "$OUT/tl_plain1024_cf$v.log" | cut -c1-150
done
t=$(left)
[ "$t" -gt 70 ] && timeout $(( t < 100 ? t : 100 )) python3 benchmarks/gpu_timeline.py \
  --synthetic 4b --prompt-tokens 1024 --loops dflash --slots 1 --tokens 48 --top 25 \
  --out "$OUT/tl_dflash1024.json" > "$OUT/tl_dflash1024.log" 2>&1
echo "tl_dflash1024 exit $? $(el)"; grep -A30 '^==' "$OUT/tl_dflash1024.log" | cut -c1-150
host_speed
pack_logs
