#!/usr/bin/env bash
# H200 call 5 of session 20 (after .device/s2/install.sh): why a plain decode step after a
# 1024-token prompt took 1.6 ms more than after a 64-token one (run 3): attention over the cache by
# context length (hf2q's row-invariant kernel and MLX's), and plain decoding after 64 and 1024
# prompt tokens in one call.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 80 python3 benchmarks/attn_cost.py --contexts 64,256,512,1024,2048,4096 --ops 16 --reps 5 \
  --out "$OUT/attn_cost.json" > "$OUT/attn_cost.log" 2>&1
echo "attn_cost exit $? $(el)"; cut -c1-160 "$OUT/attn_cost.log"
for p in 64 1024; do
  ab_run "plain_prompt$p" 80 --synthetic 4b --tokens 128 --runs 3 --prompt-tokens $p \
    --values HF2Q_GROUPED_MM=1 --modes plain
done
pack_logs
