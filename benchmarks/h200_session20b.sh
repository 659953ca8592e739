#!/usr/bin/env bash
# H200 call 2 of session 20 (after .device/s2/install.sh), with four column blocks at eight m-tiles
# for every width (the tune of call 1): the launch shapes that keep the bits at 64 and 96 rows of
# the 4B shapes (eight blocks now tried up to four m-tiles) and at 128 rows of the demo pair's,
# issue 5's runs (the 4B-shaped pair at 1/4/8 slots, the demo pair with a queue) and issue 6's
# script (verify_cost.py, the runtime's path, bf16) with today's defaults.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
node_tune node_tune4b 64,96 4b 100
node_tune node_tune_demo 128 demo 60
synthetic_variants synthetic-wide8 HF2Q_DRAFT_MM_ROWS "32"
timeout 130 python3 benchmarks/verify_cost.py --dtypes bf16 --paths runtime --reps 9 --no-profile \
  --out "$OUT/verify_cost.json" > "$OUT/verify_cost.log" 2>&1
echo "verify_cost exit $? $(el)"; tail -n 25 "$OUT/verify_cost.log" | cut -c1-200
demo_queue_bench demo-rps4
pack_logs
