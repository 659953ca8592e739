#!/usr/bin/env bash
# H200 call 3 of session 19 (after .device/s2/install.sh), grouped products now on by default:
# the CUDA tests (drafts of many rows on cuBLAS, grouped products, bf16 DFlash == plain), then
# HF2Q_DRAFT_MM_ROWS 128 against 32 alternating in one process at 4 and 8 slots (random
# 4B-shaped pair), issue 5's runs with 32 (the pair at 1/4/8 slots; the demo pair with a queue).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_matmul.py \
  -k "draft or grouped or rows_are_bit_equal" > "$OUT/cuda_tests.log" 2>&1
echo "kernel tests exit $? $(el)"; tail -n 2 "$OUT/cuda_tests.log"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_bf16_exact.py \
  > "$OUT/cuda_tests_exact.log" 2>&1
echo "bf16 exact exit $? $(el)"; tail -n 2 "$OUT/cuda_tests_exact.log"
for n in 4 8; do
  timeout 90 python3 benchmarks/plain_ab.py --synthetic 4b --slots $n --tokens 32 \
    --prompt-tokens 64 --runs 4 --values HF2Q_DRAFT_MM_ROWS=128,HF2Q_DRAFT_MM_ROWS=32 \
    --modes dflash --out "$OUT/ab_draft$n.json" > "$OUT/ab_draft$n.log" 2>&1
  echo "draft rows A/B $n slots exit $? $(el)"; tail -n 1 "$OUT/ab_draft$n.log" | cut -c1-900
done
synthetic_variants synthetic-draft HF2Q_DRAFT_MM_ROWS "32"
t=$(( ${BUDGET:-560} - ($(date +%s) - S) - 5 ))
if [ "$t" -gt 60 ]; then
  HF2Q_DRAFT_MM_ROWS=32 timeout "$t" python3 -m hf2q bench --slots 1,4,8 --requests-per-slot 4 \
    --gen-tokens 128 --trials 3 --warmup 1 --json --out "$OUT/demo-rps4.json" \
    > "$OUT/demo-rps4.log" 2>&1
  echo "demo bench exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/demo-rps4.json" \
    || tail -c 400 "$OUT/demo-rps4.log"
fi
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
