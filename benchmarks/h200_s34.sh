#!/usr/bin/env bash
# Session 34: quantized targets on the H200. Whether MLX's quantized products give a row the same
# bits at every row count (benchmarks/quant_rows.py: what lossless DFlash on a 4- or 8-bit target
# needs), then the random 4B-shaped pair with a 4-bit and an 8-bit target (DFlash tokens against
# plain decoding's, E, 4 slots / 1 slot), and with an 8-bit and a 4-bit drafter (bf16 target).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 200 python3 benchmarks/quant_rows.py --shapes 4b,head --bits 4,8 \
  --rows 1,2,3,8,16,17,32,33,64 --out "$OUT/quant_rows.json" > "$OUT/quant_rows.log" 2>&1
echo "quant_rows exit $? $(el)"; cut -c1-220 "$OUT/quant_rows.log"
# q_run NAME SLOTS ARGS...: slots_synthetic.py's 4B-shaped pair with ARGS (bits) at SLOTS.
q_run() {
  local name=$1 slots=$2 t
  shift 2
  t=$(left); [ "$t" -lt 50 ] && return
  timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots "$slots" --gen-tokens 32 \
    --prompt-tokens 64 --trials 3 --warmup 1 "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/$name.json" || tail -c 300 "$OUT/$name.log"
}
q_run syn4b_t4 1,4 --target-bits 4
q_run syn4b_t8 1,4 --target-bits 8
q_run syn4b_d8 1 --draft-bits 8
q_run syn4b_d4 1 --draft-bits 4
host_speed
pack_logs
