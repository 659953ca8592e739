#!/usr/bin/env bash
# H200 call 7 of session 20 (after .device/s2/install.sh): the product kernel's launch shapes that
# keep the bits at 32 and 48 rows (2 and 3 slots of a 16-token verify) on the 4B shapes.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 100 python3 benchmarks/node_cost.py --rows 32,48 --shapes 4b --ops 16 --reps 5 --tune \
  --out "$OUT/node_tune_32_48.json" > "$OUT/node_tune_32_48.log" 2>&1
echo "node_cost tune exit $? $(el)"
grep -v '"add"' "$OUT/node_tune_32_48.log" | grep -o '"N": [0-9]*, "rows": [0-9]*, "kind": "[^"]*".*"total_us": [0-9.]*'
