#!/usr/bin/env bash
# Session 23, call 3 (after .device/s2/install.sh): where the host's time goes in the rounds that
# the host bounds (cProfile, benchmarks/host_profile.py): the demo pair at 8 slots with lookup
# drafts (hf2q bench's setting; 1.47x plain batched in call 2, goal 1.5x) and the random
# 4B-shaped pair at one slot (E about 0.5 in call 2, goal 0.75); then the Gated-DeltaNet record's
# two ways at 2 slots (call 1 timed 4 and 8; the default now keeps the final state from 4 rows).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 150 python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain --slots 8 --lookup \
  --tokens 128 --top 45 --out "$OUT/host_demo8.json" > "$OUT/host_demo8.log" 2>&1
echo "host_demo8 exit $? $(el)"; grep -A 30 "== slots-dflash" "$OUT/host_demo8.log" | cut -c1-160
timeout 150 python3 benchmarks/host_profile.py --synthetic 4b --prompt-tokens 64 --loops slots-dflash \
  --slots 1 --tokens 32 --top 45 --out "$OUT/host_4b1.json" > "$OUT/host_4b1.log" 2>&1
echo "host_4b1 exit $? $(el)"; grep -A 30 "== slots-dflash" "$OUT/host_4b1.log" | cut -c1-160
ab_slots record_s 2 "HF2Q_GDN_RECORD=states,HF2Q_GDN_RECORD=final"
pack_logs
