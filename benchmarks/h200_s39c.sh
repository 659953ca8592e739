#!/usr/bin/env bash
# Session 39, third call: (1) kernel_trace.py, the device time of every bit-keeping launch of the
# one-row and 16-row products whose plain-step trace shows about 2.4 TB/s (the down and output
# projections, N = 2560, with their residual add: 160 blocks at the default launch), and of the
# tied head at 16 rows (about 0.6 ms in a round against 0.3 at one row), and of the attention
# kernel's heads per block; (2) plain and DFlash decoding at 1024 (plain_ab.py) with two heads a
# block by default; (3) the floor and the verify cost (verify_cost.py).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 200 python3 benchmarks/kernel_trace.py --products 9216x2560,4096x2560,2560x248320 \
  --rows 1,16 --attention --reps 20 --out "$OUT/kernel_trace.json" > "$OUT/kernel_trace.log" 2>&1
echo "kernel_trace exit $? $(el)"; grep -o '"job": "[^"]*".*"us_median": [0-9.]*' "$OUT/kernel_trace.log" \
  | sed 's/"kernels": \[[^]]*\], //' | cut -c1-130
tail -n 3 "$OUT/kernel_trace.log" | grep -v '^{' | cut -c1-300
t=$(left)
[ "$t" -gt 100 ] && ab_run ab1024 90 --synthetic 4b --modes plain,dflash --tokens 64 \
  --prompt-tokens 1024 --runs 5
t=$(left)
[ "$t" -gt 60 ] && timeout "$t" python3 benchmarks/verify_cost.py --dtypes bf16 --paths runtime \
  --reps 9 --no-profile --budget-s $(( t - 20 )) --out "$OUT/verify_cost.json" > "$OUT/verify_cost.log" 2>&1
echo "verify_cost exit $? $(el)"; grep -vE '^\s*$' "$OUT/verify_cost.log" | tail -n 14 | cut -c1-200
host_speed
pack_logs
