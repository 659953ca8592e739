#!/usr/bin/env bash
# Session 17, second H200 call: where bf16 DFlash parts from plain greedy decoding on the
# 4B-shaped pair (run 1's plain_ab: tokens differ with a 1024-token prompt), then the lagged
# rounds' bf16 tests on the GPU with the rest of the budget (run 1 ran out of time in them).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 240 python3 benchmarks/lossless_diag.py --synthetic 4b --prompt-tokens 64,1024 \
  --settings default,HF2Q_SDPA_BUCKET=0,HF2Q_PREFILL_RUNNERS=0 --out "$OUT/diag4b.jsonl" \
  > "$OUT/diag4b.log" 2>&1
echo "diag 4b exit $? $(el)"; grep '^{' "$OUT/diag4b.log" || tail -c 1500 "$OUT/diag4b.log"
timeout 90 python3 benchmarks/lossless_diag.py --prompt-tokens 64,1024 --out "$OUT/diagdemo.jsonl" \
  > "$OUT/diagdemo.log" 2>&1
echo "diag demo exit $? $(el)"; grep '^{' "$OUT/diagdemo.log" || tail -c 1500 "$OUT/diagdemo.log"
t=$(( ${BUDGET:-560} - ($(date +%s) - S) ))
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m pytest -q -x tests/test_runtime_bf16_exact.py tests/test_slots_isolation.py -k lagged \
    -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1
  echo "tests exit $? $(el)"; tail -n 3 "$OUT/cuda_tests.log"
fi
