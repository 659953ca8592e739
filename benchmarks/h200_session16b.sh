#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): every verify row on the small-M kernel
# (HF2Q_SMALL_MM_ROWS=128) so that batched greedy DFlash of a large model keeps the decode step's
# bits at 3 slots and more (session 16: with cuBLAS above 32 rows, 4-slot rows of the 4B-shaped
# pair matched plain batched decoding 0%):
# 1. benchmarks/node_cost.py --tune at 64 rows of the 4B shapes (kernel launch shapes vs cuBLAS);
# 2. benchmarks/slots_synthetic.py --shape 4b --slots 1,4 with HF2Q_SMALL_MM_ROWS=128;
# 3. tests/test_runtime_bf16_exact.py with it.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 120 python3 benchmarks/node_cost.py --tune --rows 64 --shapes 4b --ops 16 --reps 5 \
  --out "$OUT/node_cost64.json" > "$OUT/node_cost64.log" 2>&1
echo "node_cost exit $? $(el)"
grep '"rows": 64, "kind"' "$OUT/node_cost64.log" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin]
for shape in sorted({(r["K"], r["N"]) for r in rows}):
    rs = sorted((r for r in rows if (r["K"], r["N"]) == shape and "GB_s" in r), key=lambda r: r["total_us"])
    print(shape, [(r["kind"].replace("hf2q_small_mm", "k"), r["total_us"]) for r in rs[:5]],
          "mlx", [r["total_us"] for r in rs if r["kind"] == "mlx_matmul"],
          "default", [r["total_us"] for r in rs if r["kind"] == "hf2q_small_mm"])'
HF2Q_SMALL_MM_ROWS=128 timeout 150 python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4 \
  --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/slots4b_rows128.json" \
  > "$OUT/slots4b_rows128.log" 2>&1
echo "slots_synthetic exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/slots4b_rows128.json" || tail -c 600 "$OUT/slots4b_rows128.log"
t=$(( ${BUDGET:-380} - ($(date +%s) - S) ))
if [ "$t" -gt 30 ]; then
  HF2Q_SMALL_MM_ROWS=128 timeout "$t" python3 -m pytest -q -x tests/test_runtime_bf16_exact.py \
    > "$OUT/tests_bf16_rows128.log" 2>&1
  echo "bf16 tests exit $? $(el)"; tail -n 3 "$OUT/tests_bf16_rows128.log"
fi
