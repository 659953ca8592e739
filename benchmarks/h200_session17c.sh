#!/usr/bin/env bash
# Session 17, third H200 call (commit 3a77a5d, the unpadded prefill): bf16 greedy DFlash against
# plain decoding on the 4B-shaped pair again (lossless_diag, default settings), the fix's CUDA
# tests and the bf16 exactness tests, the single-sequence lagged A/B again (now every run's tokens
# should equal plain's), then the 4B pair at 1/4/8 slots lagged and synchronous (reverse order of
# run 1) in the time left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 120 python3 benchmarks/lossless_diag.py --synthetic 4b --prompt-tokens 64,1024 \
  --out "$OUT/diag4b.jsonl" > "$OUT/diag4b.log" 2>&1
echo "diag 4b exit $? $(el)"; grep '^{' "$OUT/diag4b.log" || tail -c 1500 "$OUT/diag4b.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_sdpa_bucket.py \
  tests/test_runtime_bf16_exact.py -k "not lagged" > "$OUT/cuda_tests.log" 2>&1
echo "tests exit $? $(el)"; tail -n 3 "$OUT/cuda_tests.log"
timeout 130 python3 benchmarks/plain_ab.py --synthetic 4b --tokens 64 --runs 4 \
  --values HF2Q_LAGGED_ROUNDS=0,HF2Q_LAGGED_ROUNDS=1 --modes plain,dflash \
  --out "$OUT/ab_lagged.json" > "$OUT/ab_lagged.log" 2>&1
echo "plain_ab exit $? $(el)"; tail -n 1 "$OUT/ab_lagged.log" | cut -c1-1200
t=$(( ${BUDGET:-540} - ($(date +%s) - S) ))
if [ "$t" -gt 150 ]; then
  VARIANTS="HF2Q_LAGGED_ROUNDS=1 HF2Q_LAGGED_ROUNDS=0" SLOTS=1,4,8 TESTS=none \
    VARIANT_S=$(( (t - 10) / 2 )) bash benchmarks/h200_variants.sh
fi
