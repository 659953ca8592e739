#!/usr/bin/env bash
# Next H200 call (after .device/s2/install.sh): lagged rounds (HF2Q_LAGGED_ROUNDS=1, single and batched
# DFlash without lookup; each round queued before the last acceptance is read) against
# the synchronous round, on the 4B-shaped pair (1, 4, 8 slots) and the demo pair (--no-lookup),
# then their bf16 tests on the GPU. Session 16 measured only the CPU, where they are slower (no
# device to overlap with).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
# Single sequence, alternating in one process: plain step, DFlash round and E, both ways.
timeout 150 python3 benchmarks/plain_ab.py --synthetic 4b --tokens 64 --runs 4 \
  --values HF2Q_LAGGED_ROUNDS=0,HF2Q_LAGGED_ROUNDS=1 --modes plain,dflash \
  --out "$OUT/ab_lagged.json" > "$OUT/ab_lagged.log" 2>&1
echo "plain_ab exit $? [$(( $(date +%s) - S ))s]"; tail -n 1 "$OUT/ab_lagged.log" | cut -c1-900
VARIANTS="HF2Q_LAGGED_ROUNDS=0 HF2Q_LAGGED_ROUNDS=1" SLOTS=${SLOTS:-1,4,8} TESTS=none \
  VARIANT_S=130 bash benchmarks/h200_variants.sh
for v in 0 1; do
  HF2Q_LAGGED_ROUNDS=$v timeout 100 python3 -m hf2q bench --slots 1,8 --no-lookup --gen-tokens 128 \
    --trials 3 --warmup 1 --json --out "$OUT/demo-lagged$v.json" > "$OUT/demo-lagged$v.log" 2>&1
  echo "demo lagged=$v exit $? [$(( $(date +%s) - S ))s]"
  python3 benchmarks/bench_rows.py "$OUT/demo-lagged$v.json" || tail -c 400 "$OUT/demo-lagged$v.log"
done
t=$(( ${BUDGET:-560} - ($(date +%s) - S) ))
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m pytest -q -x tests/test_runtime_bf16_exact.py tests/test_slots_isolation.py -k lagged \
    > "$OUT/cuda_tests.log" 2>&1
  echo "tests exit $? [$(( $(date +%s) - S ))s]"; tail -n 3 "$OUT/cuda_tests.log"
fi
