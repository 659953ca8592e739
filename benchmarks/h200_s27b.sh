#!/usr/bin/env bash
# Session 27, second call: where a 1-slot round's time goes on a host-bound machine (run 1 of this
# session: the 1-slot round 11.7 ms, the plain step 6.0, against 6.8 / 3.7 on session 25's hosts).
# (1) cProfile of the host thread, the 4B-shaped pair's slot loops at one slot, DFlash and plain;
# (2) kernel traces of a 1-slot DFlash round with the one-row writes as slice updates at a device
# offset and as scatters (HF2Q_KV_ROW_SCATTER=0|1: launches and device time, which the host's
# speed does not move), and of a 1-slot plain step.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 150 python3 benchmarks/host_profile.py --synthetic 4b --prompt-tokens 64 \
  --loops slots-dflash,slots-plain --slots 1 --tokens 48 --top 45 --out "$OUT/host_s1.json" \
  > "$OUT/host_s1.log" 2>&1
echo "host_s1 exit $? $(el)"; cut -c1-170 "$OUT/host_s1.log" | grep -v "^\s*$" | head -120
for v in 0 1; do
  t=$(left); [ "$t" -lt 90 ] && break
  HF2Q_KV_ROW_SCATTER=$v timeout 80 python3 benchmarks/gpu_timeline.py --synthetic 4b \
    --prompt-tokens 64 --slots 1 --tokens 32 --top 45 --loops slots-dflash \
    --out "$OUT/tl_kv$v.json" > "$OUT/tl_kv$v.log" 2>&1
  echo "tl_kv$v exit $? $(el)"; grep -A52 '^==' "$OUT/tl_kv$v.log" | cut -c1-150
done
t=$(left)
if [ "$t" -gt 90 ]; then
  timeout 80 python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --slots 1 \
    --tokens 32 --top 45 --loops slots-plain --out "$OUT/tl_plain.json" > "$OUT/tl_plain.log" 2>&1
  echo "tl_plain exit $? $(el)"; grep -A52 '^==' "$OUT/tl_plain.log" | cut -c1-150
fi
pack_logs
