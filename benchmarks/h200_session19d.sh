#!/usr/bin/env bash
# H200 call 4 of session 19 (after .device/s2/install.sh), this session's defaults (grouped
# products on, large drafters' drafts of more than 32 rows on cuBLAS): the tied head's launch
# shapes that keep the bits (node_cost --tune), grouped products off/on alternating on the demo
# pair at 8 slots, and issue 5's runs (the 4B-shaped pair at 1/4/8 slots, the demo pair with a queue).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 90 python3 benchmarks/node_cost.py --rows 64,128 --shapes head4b --ops 2 --reps 5 --tune \
  --out "$OUT/node_head_tune.json" > "$OUT/node_head_tune.log" 2>&1
echo "node_cost head tune exit $? $(el)"
grep -v '"add"' "$OUT/node_head_tune.log" | grep -o '"rows": [0-9]*, "kind": "[^"]*".*"total_us": [0-9.]*'
timeout 120 python3 benchmarks/plain_ab.py --demo --lookup --slots 8 --tokens 128 --runs 4 \
  --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain,dflash \
  --out "$OUT/ab_grouped_demo8.json" > "$OUT/ab_grouped_demo8.log" 2>&1
echo "grouped A/B demo 8 slots exit $? $(el)"; tail -n 1 "$OUT/ab_grouped_demo8.log" | cut -c1-1200
synthetic_variants synthetic-final HF2Q_DRAFT_MM_ROWS "32"
t=$(( ${BUDGET:-560} - ($(date +%s) - S) - 5 ))
if [ "$t" -gt 60 ]; then
  timeout "$t" python3 -m hf2q bench --slots 1,4,8 --requests-per-slot 4 \
    --gen-tokens 128 --trials 3 --warmup 1 --json --out "$OUT/demo-rps4.json" \
    > "$OUT/demo-rps4.log" 2>&1
  echo "demo bench exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/demo-rps4.json" \
    || tail -c 400 "$OUT/demo-rps4.log"
fi
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
