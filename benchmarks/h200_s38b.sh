#!/usr/bin/env bash
# Session 38, second call: the compiled whole decode step (HF2Q_COMPILE_FORWARD=1) with its KV
# write as a scatter (the first call's trace: the slice update at an array position, 19 us a
# write, cost the compiled step 0.33 ms of device time a token). (1) the bf16 4B-shaped target's
# floor and decode-1 by itself (verify_cost.py, runtime path), (2) plain decoding after 1024 and
# 64 prompt tokens, the switch off / on alternating in one process, DFlash too at 1024, (3) a
# kernel trace of the compiled step at 1024, (4) the GPU tests of the compiled step (now bit for
# bit against the layer path) and bf16 DFlash = plain with the switch on.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 150 python3 benchmarks/verify_cost.py --dtypes bf16 --paths runtime --reps 9 --no-profile \
  --budget-s 100 --out "$OUT/verify_cost.json" > "$OUT/verify_cost.log" 2>&1
echo "verify_cost exit $? $(el)"; grep -vE '^\s*$' "$OUT/verify_cost.log" | tail -n 14 | cut -c1-200
ab_run ab_cf1024 150 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 1024 --runs 5 \
  --env HF2Q_COMPILE_FORWARD --values 0,1
ab_run ab_cf64 120 --synthetic 4b --modes plain --tokens 64 --prompt-tokens 64 --runs 5 \
  --env HF2Q_COMPILE_FORWARD --values 0,1
t=$(left)
[ "$t" -gt 150 ] && HF2Q_COMPILE_FORWARD=1 timeout 80 python3 benchmarks/gpu_timeline.py \
  --synthetic 4b --prompt-tokens 1024 --loops plain --slots 1 --tokens 48 --top 25 \
  --out "$OUT/tl_plain1024_cf1.json" > "$OUT/tl_plain1024_cf1.log" 2>&1
echo "tl_plain1024_cf1 exit $? $(el)"; grep -A22 '^==' "$OUT/tl_plain1024_cf1.log" | cut -c1-150
t=$(left)
[ "$t" -gt 40 ] && HF2Q_COMPILE_FORWARD=1 gpu_pytest pytest_cf "$t" tests/test_kernels_forward.py \
  tests/test_runtime_bf16_exact.py
host_speed
pack_logs
