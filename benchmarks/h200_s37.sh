#!/usr/bin/env bash
# Session 37, one call: issue 6's isolated costs for the 4-bit 4B-shaped target at the final commit
# (session 36's call ran out of its budget after the 4-bit decode-1): verify_cost.py's decode-1 /
# verify-16 / draft-16 / rollback for stock mlx-lm and hf2q's runtime (the dequantizing kernel) at
# the 1024-token context, then plain decoding and DFlash of the 4-bit pair after a
# 1024-token prompt in the decode loops.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 330 python3 benchmarks/verify_cost.py --dtypes 4bit --paths stock,runtime --reps 9 \
  --no-profile --budget-s 260 --out "$OUT/verify_cost_4bit.json" > "$OUT/verify_cost_4bit.log" 2>&1
echo "verify_cost exit $? $(el)"; grep -vE '^\s*$' "$OUT/verify_cost_4bit.log" | tail -n 20 | cut -c1-200
t=$(left)
[ "$t" -gt 60 ] && ab_run ab4_ctx1024 "$t" --synthetic 4b --target-bits 4 --modes plain,dflash \
  --tokens 32 --prompt-tokens 1024 --runs 3 --env HF2Q_COMPILE_FORWARD --values 0
host_speed
pack_logs
