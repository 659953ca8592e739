#!/usr/bin/env bash
# H200 call 6 of session 20 (after .device/s2/install.sh): where the host's time goes in a lagged
# DFlash round of the 4B-shaped pair (one sequence and 4 slots) and in a plain step (cProfile of
# the host thread; MLX's own calls count in their Python callers' tottime).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 150 python3 benchmarks/host_profile.py --synthetic 4b --prompt-tokens 64 \
  --loops dflash,plain,slots-dflash --slots 4 --tokens 48 --top 30 \
  --out "$OUT/host_profile_4b.json" > "$OUT/host_profile_4b.log" 2>&1
echo "host_profile exit $? $(el)"; cut -c1-170 "$OUT/host_profile_4b.log" | grep -v "^\s*$" | tail -n 100
