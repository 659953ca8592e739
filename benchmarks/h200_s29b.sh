#!/usr/bin/env bash
# Session 29, second call: lagged rounds with the lookup proposals built on the device
# (HF2Q_LAGGED_LOOKUP=device, hf2q.runtime.lookup.RowsLookup) against the default synchronous
# lookup rounds, on hf2q bench's workload (demo pair, built-in prompts, 4 requests a slot, 128
# tokens), alternating in one process (benchmarks/bench_ab.py), at 1 and 8 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout "$(left)" python3 benchmarks/bench_ab.py --slots "${SLOTS:-8,1}" --runs 3 \
  --values HF2Q_LAGGED_LOOKUP=0,HF2Q_LAGGED_LOOKUP=device --out "$OUT/ab_lookup.json" \
  > "$OUT/ab_lookup.log" 2>&1
echo "ab_lookup exit $? $(el)"; grep -v '^{"values' "$OUT/ab_lookup.log" | cut -c1-400 | tail -n 40
