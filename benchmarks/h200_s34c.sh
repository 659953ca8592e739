#!/usr/bin/env bash
# Session 34: launch shapes of the dequantizing small-M kernel (plain decoding of a 4-bit target
# ran 4.57 -> 6.24 ms a token with it, h200_s34b.sh PART=runs): quant_rows.py --tune times each
# (column blocks, warps, unrolling) against MLX's product and the default launch, in turn, at
# 1, 16 and 64 rows of the 4B shapes and the head, 4-bit; then plain decoding and DFlash of the
# 4-bit 4B-shaped pair with MLX's product, the default launch and another (HF2Q_QMM_LAUNCH),
# alternating in one process. (Session 35 ran it with 4x16x1 as well, which the setting refuses:
# at most 8 warps; that A/B was re-run with the values in benchmarks/results/h200/session35.)
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
C="1,8,1;2,8,1;4,8,1;8,8,1;2,8,2;4,8,2;4,8,4;8,8,2;2,16,1;4,16,1;8,16,1;4,4,1;8,4,1;8,4,2"
timeout "${TUNE_S:-170}" python3 benchmarks/quant_rows.py --shapes 4b,head --bits 4 --rows 1,16,64 \
  --reps 5 --tune "$C" --out "$OUT/qtune.json" > "$OUT/qtune.log" 2>&1
echo "qtune exit $? $(el)"; cut -c1-400 "$OUT/qtune.log"
V="HF2Q_SMALL_QMM=0,HF2Q_SMALL_QMM=1,HF2Q_QMM_LAUNCH=8x8x2"
ab_run ab_launch "$(left)" --synthetic 4b --target-bits 4 --modes plain,dflash --tokens 32 \
  --prompt-tokens 64 --runs 3 --env HF2Q_QMM_LAUNCH --values "$V"
pack_logs
