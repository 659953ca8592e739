#!/usr/bin/env bash
# H200 call (after .device/s2/install.sh): HF2Q_EARLY_VERIFY (a synchronous round queues its verify
# before it waits for the draft) off / on, alternating in one process: the demo pair with lookup
# (the CLI's default; rounds synchronous), the random 4B-shaped pair with synchronous rounds (and
# lagged ones for reference); hf2q bench at 8 slots with a queue each way; then the switch's tests.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 110 python3 benchmarks/plain_ab.py --demo --lookup --tokens 128 --runs 5 \
  --values HF2Q_EARLY_VERIFY=0,HF2Q_EARLY_VERIFY=1 --modes plain,dflash \
  --out "$OUT/ab_early_demo.json" > "$OUT/ab_early_demo.log" 2>&1
echo "demo A/B exit $? $(el)"; tail -n 1 "$OUT/ab_early_demo.log" | cut -c1-1600
timeout 170 python3 benchmarks/plain_ab.py --synthetic 4b --tokens 64 --runs 4 --values \
  HF2Q_LAGGED_ROUNDS=0+HF2Q_EARLY_VERIFY=0,HF2Q_LAGGED_ROUNDS=0+HF2Q_EARLY_VERIFY=1,HF2Q_LAGGED_ROUNDS=1+HF2Q_EARLY_VERIFY=0 \
  --modes plain,dflash --out "$OUT/ab_early_4b.json" > "$OUT/ab_early_4b.log" 2>&1
echo "4b A/B exit $? $(el)"; tail -n 1 "$OUT/ab_early_4b.log" | cut -c1-1600
for v in 0 1; do
  HF2Q_EARLY_VERIFY=$v timeout 90 python3 -m hf2q bench --slots 8 --requests-per-slot 4 \
    --gen-tokens 128 --trials 3 --warmup 1 --json --out "$OUT/demo8-early$v.json" \
    > "$OUT/demo8-early$v.log" 2>&1
  echo "demo 8 slots early=$v exit $? $(el)"
  python3 benchmarks/bench_rows.py "$OUT/demo8-early$v.json" || tail -c 400 "$OUT/demo8-early$v.log"
done
t=$(( ${BUDGET:-540} - ($(date +%s) - S) ))
if [ "$t" -gt 30 ]; then
  timeout "$t" python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_lookup.py \
    tests/test_runtime_flush.py -k "early" > "$OUT/cuda_tests.log" 2>&1
  echo "tests exit $? $(el)"; tail -n 3 "$OUT/cuda_tests.log"
fi
