#!/usr/bin/env bash
# H200 call (after .device/s2/install.sh): column partitions in the small-M product kernel
# (HF2Q_MM_PARTS). node_cost.py times the 4B shapes at 64 and 128 rows with 1, 2, 4 partitions;
# the CUDA tests check the bits; then the random 4B-shaped pair at 1, 4, 8 slots with one
# partition and with the fastest of 2 and 4 (one process each), unless 1 was fastest.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 90 python3 benchmarks/node_cost.py --rows 64,128 --shapes 4b --ops 16 --reps 5 --parts \
  --out "$OUT/node_parts.json" > "$OUT/node_parts.log" 2>&1
echo "node_cost exit $? $(el)"
best=$(python3 - "$OUT/node_parts.json" <<'PY'
import json, sys
from collections import defaultdict
tot = defaultdict(float)
for r in json.load(open(sys.argv[1]))["results"]:
    if r["kind"].startswith("hf2q_small_mm") or r["kind"] == "mlx_matmul":
        print(r["rows"], r["K"], r["N"], r["kind"], r["total_us"], r.get("GB_s"), file=sys.stderr)
    if r["kind"].startswith("hf2q_small_mm_parts") and r["rows"] == 64:
        tot[int(r["kind"][-1])] += r["total_us"]
print(min(tot, key=tot.get) if tot else 1)
PY
)
echo "fastest partitions at 64 rows: $best"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_matmul.py \
  -k "partitions or rows_are_bit_equal" > "$OUT/cuda_tests.log" 2>&1
echo "tests exit $? $(el)"; tail -n 2 "$OUT/cuda_tests.log"
for P in 1 $best; do
  [ "$P" = 1 ] && [ -f "$OUT/synthetic-parts1.json" ] && continue
  t=$(( ${BUDGET:-440} - ($(date +%s) - S) - 5 ))
  [ "$t" -lt 40 ] && break
  HF2Q_MM_PARTS=$P timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4,8 \
    --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/synthetic-parts$P.json" \
    > "$OUT/synthetic-parts$P.log" 2>&1
  echo "synthetic parts=$P exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/synthetic-parts$P.json" || tail -c 400 "$OUT/synthetic-parts$P.log"
done
