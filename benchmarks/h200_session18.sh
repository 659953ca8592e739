#!/usr/bin/env bash
# Next H200 call (after .device/s2/install.sh): lookup with lagged rounds (HF2Q_LAGGED_LOOKUP=1:
# lagged while the drafter drafts, synchronous while a lookup proposal is due) against lookup
# with synchronous rounds (the default), on the demo pair's looping prompt (single sequence,
# alternating in one process) and in hf2q bench's default run (lookup on); then the session-17
# lossless check of the 4B-shaped pair after the prefill fix, and the tests.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 120 python3 benchmarks/plain_ab.py --demo --lookup --tokens 128 --runs 5 \
  --values HF2Q_LAGGED_LOOKUP=0,HF2Q_LAGGED_LOOKUP=1 --modes plain,dflash \
  --out "$OUT/ab_lookup.json" > "$OUT/ab_lookup.log" 2>&1
echo "plain_ab exit $? $(el)"; tail -n 1 "$OUT/ab_lookup.log" | cut -c1-1500
for v in 0 1; do
  HF2Q_LAGGED_LOOKUP=$v timeout 100 python3 -m hf2q bench --slots 1,8 --gen-tokens 128 \
    --trials 3 --warmup 1 --json --out "$OUT/demo-lookup$v.json" > "$OUT/demo-lookup$v.log" 2>&1
  echo "demo lagged lookup=$v exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/demo-lookup$v.json" || tail -c 400 "$OUT/demo-lookup$v.log"
done
timeout 200 python3 benchmarks/lossless_diag.py --synthetic 4b --prompt-tokens 64,1024 \
  --out "$OUT/diag4b.jsonl" > "$OUT/diag4b.log" 2>&1
echo "diag 4b exit $? $(el)"; grep '^{' "$OUT/diag4b.log" || tail -c 800 "$OUT/diag4b.log"
t=$(( ${BUDGET:-560} - ($(date +%s) - S) ))
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_lookup.py \
    tests/test_runtime_sdpa_bucket.py tests/test_runtime_bf16_exact.py > "$OUT/cuda_tests.log" 2>&1
  echo "tests exit $? $(el)"; tail -n 3 "$OUT/cuda_tests.log"
fi
