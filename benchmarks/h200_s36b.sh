#!/usr/bin/env bash
# Session 36, second call: issue 6's isolated costs at the final commit, at the issue's 1024-token
# context: verify_cost.py's decode-1 / verify-16 / draft-16 / rollback for stock mlx-lm and hf2q's
# runtime (bf16 and 4-bit 4B-shaped target, the bandwidth floor from this machine's copy speed),
# then plain decoding and DFlash of the 4B-shaped pair after a 1024-token prompt.
# Settings (defaults: session 36's call): DTYPES (bf16,4bit), VC_BUDGET (170 s for verify_cost,
# which gets 60 s more to finish), TARGET_BITS (0: bf16 pair in the decode loops), NAME ("": the
# files verify_cost.json and ab_ctx1024.json; "4bit": verify_cost_4bit.json and ab4_ctx1024.json).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
DTYPES=${DTYPES:-bf16,4bit} VC_BUDGET=${VC_BUDGET:-170} TARGET_BITS=${TARGET_BITS:-0}
vc=verify_cost${NAME:+_$NAME} ab=ab${NAME:+${NAME%bit}}_ctx1024
host_speed
timeout $(( VC_BUDGET + 60 )) python3 benchmarks/verify_cost.py --dtypes "$DTYPES" \
  --paths stock,runtime --reps 9 --no-profile --budget-s "$VC_BUDGET" --out "$OUT/$vc.json" \
  > "$OUT/$vc.log" 2>&1
echo "verify_cost exit $? $(el)"; grep -vE '^\s*$' "$OUT/$vc.log" | tail -n 30 | cut -c1-200
t=$(left)
[ "$t" -gt 60 ] && ab_run "$ab" "$t" --synthetic 4b --target-bits "$TARGET_BITS" --modes plain,dflash \
  --tokens 32 --prompt-tokens 1024 --runs 3 --env HF2Q_COMPILE_FORWARD --values 0
host_speed
pack_logs
