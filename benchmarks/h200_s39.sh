#!/usr/bin/env bash
# Session 39, first call: the row-invariant attention kernel now issues a key group's key and
# value loads before using any (and its chunk merge four chunks' loads at once), the same
# arithmetic in the same order. Session 38's trace of a plain step at 1024 positions: 35 us a
# layer for about 4 MB of keys and values, 0.36 ms of the step's 3.7 busy. (1) attn_cost.py, the
# kernel against the previous version (BASE, a copy of the old file) side by side, bits compared,
# at the target's and the drafter's shapes; (2) the attention GPU tests; (3) kernel traces of plain
# steps and DFlash rounds at 1024 positions; (4) plain and DFlash decoding at 1024 (plain_ab.py).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
BASE=${BASE:-.device/s2/old_cuda_attention.py}
host_speed
timeout 90 python3 benchmarks/attn_cost.py --shape target --contexts 256,1024,4096 --rows 1,16 \
  --ops 16 --reps 7 --baseline "$BASE" --out "$OUT/attn_target.json" > "$OUT/attn_target.log" 2>&1
echo "attn target exit $? $(el)"; grep -v mlx_sdpa "$OUT/attn_target.log" | cut -c1-200
timeout 60 python3 benchmarks/attn_cost.py --shape drafter --contexts 1040,4112 --rows 16 \
  --ops 16 --reps 7 --baseline "$BASE" --out "$OUT/attn_drafter.json" > "$OUT/attn_drafter.log" 2>&1
echo "attn drafter exit $? $(el)"; grep -v mlx_sdpa "$OUT/attn_drafter.log" | cut -c1-200
gpu_pytest pytest_attn 100 tests/test_kernels_row_attention.py tests/test_runtime_bf16_exact.py
for loop in plain dflash; do
  t=$(left); [ "$t" -lt 70 ] && break
  timeout $(( t < 90 ? t : 90 )) python3 benchmarks/gpu_timeline.py --synthetic 4b \
    --prompt-tokens 1024 --loops $loop --slots 1 --tokens 48 --top 25 \
    --out "$OUT/tl_${loop}1024.json" > "$OUT/tl_${loop}1024.log" 2>&1
  echo "tl_${loop}1024 exit $? $(el)"; grep -A30 '^==' "$OUT/tl_${loop}1024.log" | cut -c1-150
done
t=$(left)
[ "$t" -gt 60 ] && ab_run ab1024 "$t" --synthetic 4b --modes plain,dflash --tokens 64 \
  --prompt-tokens 1024 --runs 5
host_speed
pack_logs
