#!/usr/bin/env bash
# H200 call 2 of session 19 (after .device/s2/install.sh): drafts of many rows on cuBLAS
# (HF2Q_DRAFT_MM_ROWS; draft logits only propose, so they need not be row-invariant), the tied
# head's product at 16-128 rows (kernel against cuBLAS), and the grouped products again
# (HF2Q_GROUPED_MM: 5.77 -> 5.07 ms a plain token in run 1, within noise in session 16).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 60 python3 benchmarks/node_cost.py --rows 16,64,128 --shapes head4b --ops 2 --reps 5 \
  --out "$OUT/node_head.json" > "$OUT/node_head.log" 2>&1
echo "node_cost head exit $? $(el)"; grep -v '"add"' "$OUT/node_head.log" | cut -c1-150
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_matmul.py \
  -k "draft or rows_are_bit_equal" > "$OUT/cuda_tests.log" 2>&1
echo "kernel tests exit $? $(el)"; tail -n 2 "$OUT/cuda_tests.log"
synthetic_variants synthetic-draft HF2Q_DRAFT_MM_ROWS "128 32"
synthetic_variants synthetic-grouped HF2Q_GROUPED_MM "1"
t=$(( ${BUDGET:-560} - ($(date +%s) - S) - 5 ))
if [ "$t" -gt 60 ]; then
  timeout "$t" python3 benchmarks/plain_ab.py --synthetic 4b --tokens 128 --runs 5 \
    --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain,dflash \
    --out "$OUT/ab_grouped.json" > "$OUT/ab_grouped.log" 2>&1
  echo "grouped A/B exit $? $(el)"; tail -n 1 "$OUT/ab_grouped.log" | cut -c1-1200
fi
# What comes back is limited in files: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
