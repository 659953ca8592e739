#!/usr/bin/env bash
# H200 call 2 of session 21 (after .device/s2/install.sh): issue 5's runs with eight column blocks
# at three m-tiles (now the default): the 4B-shaped pair at 1, 3, 4 and 8 slots; the demo pair with
# a queue at 8 slots with lookup rounds synchronous (the default) and lagged
# (HF2Q_LAGGED_LOOKUP=1, never measured at 8 slots); where the host's time goes in the demo pair's
# 8-slot rounds (lookup on, as hf2q bench runs).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
synthetic_run synthetic 1,3,4,8 200
for v in 0 1; do
  t=$(left); [ "$t" -lt 100 ] && break
  HF2Q_LAGGED_LOOKUP=$v timeout "$t" python3 -m hf2q bench --slots 8 --requests-per-slot 4 \
    --gen-tokens 128 --trials 3 --warmup 1 --json --out "$OUT/demo8-ll$v.json" > "$OUT/demo8-ll$v.log" 2>&1
  echo "demo8 HF2Q_LAGGED_LOOKUP=$v exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/demo8-ll$v.json" || tail -c 300 "$OUT/demo8-ll$v.log"
done
t=$(left)
if [ "$t" -gt 40 ]; then
  timeout "$t" python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain --slots 8 \
    --tokens 128 --lookup --top 30 --out "$OUT/host_profile_demo8.json" > "$OUT/host_profile_demo8.log" 2>&1
  echo "host_profile exit $? $(el)"; grep "^==" "$OUT/host_profile_demo8.log"
fi
pack_logs
