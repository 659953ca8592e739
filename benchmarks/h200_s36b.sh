#!/usr/bin/env bash
# Session 36, second call: issue 6's isolated costs at the final commit, at the issue's 1024-token
# context: verify_cost.py's decode-1 / verify-16 / draft-16 / rollback for stock mlx-lm and hf2q's
# runtime (bf16 and 4-bit 4B-shaped target, the bandwidth floor from this machine's copy speed),
# then plain decoding and DFlash of the bf16 4B-shaped pair after a 1024-token prompt.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 230 python3 benchmarks/verify_cost.py --dtypes bf16,4bit --paths stock,runtime --reps 9 \
  --no-profile --budget-s 170 --out "$OUT/verify_cost.json" > "$OUT/verify_cost.log" 2>&1
echo "verify_cost exit $? $(el)"; grep -vE '^\s*$' "$OUT/verify_cost.log" | tail -n 30 | cut -c1-200
t=$(left)
[ "$t" -gt 60 ] && ab_run ab_ctx1024 "$t" --synthetic 4b --modes plain,dflash --tokens 32 \
  --prompt-tokens 1024 --runs 3 --env HF2Q_COMPILE_FORWARD --values 0
host_speed
pack_logs
