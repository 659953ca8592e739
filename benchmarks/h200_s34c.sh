#!/usr/bin/env bash
# Session 34: launch shapes of the dequantizing small-M kernel (plain decoding of a 4-bit target
# ran 4.57 -> 6.24 ms a token with it, h200_s34b.sh PART=runs): quant_rows.py --tune times each
# (column blocks, warps, unrolling) against MLX's product and the default launch, in turn, at
# 1, 16 and 64 rows of the 4B shapes and the head, 4-bit.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
C="1,8,1;2,8,1;4,8,1;8,8,1;2,8,2;4,8,2;4,8,4;8,8,2;2,16,1;4,16,1;8,16,1;4,4,1;8,4,1;8,4,2"
timeout "$(left)" python3 benchmarks/quant_rows.py --shapes 4b,head --bits 4 --rows 1,16,64 \
  --reps 5 --tune "$C" --out "$OUT/qtune.json" > "$OUT/qtune.log" 2>&1
echo "qtune exit $? $(el)"; cut -c1-400 "$OUT/qtune.log"
pack_logs
