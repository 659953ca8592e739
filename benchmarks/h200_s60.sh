#!/usr/bin/env bash
# The next lease's call, BUDGET=540 (an H200 for the goals; an H100 answers the questions too).
# Session 59 (H100, fast host) timed four graph-node cuts: the gated norm's launch is now the
# default; all four with SwiGLU in the gate/up launch at one m-tile made the one-slot round
# 5.926 -> 5.617 ms (E 0.709 -> 0.729), but HF2Q_NORM_ROPE alone made it 6.983 while all four
# (it among them) made it 5.830: not explained. Its call's pytest limit cut the attention gate's
# and the compiled step's CUDA tests. Here:
# 1. those CUDA tests (the gate's store against MLX's multiply, the compiled step with the cuts);
# 1b. the layers' norms in their products' launches (HF2Q_NORM_MM, session 60): bits against
#    MLX's norm kernel then the product, and the demo target's logits on and off;
# 2. the one-slot A/B: the defaults, HF2Q_NORM_MM alone, the four with the SwiGLU launch at one
#    m-tile without and with HF2Q_NORM_MM, NORM_ROPE alone;
# 3. the goals' sweep, defaults against the four + SwiGLU at one m-tile + HF2Q_NORM_MM, alternated;
# 4. a one-slot kernel trace of NORM_ROPE alone (are its graphs rebuilt each round?).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_pytest cut_bits 150 tests/test_kernels_norm_mm.py tests/test_kernels_row_attention.py \
  tests/test_kernels_forward.py tests/test_kernels_gated_norm.py -k "cuda or demo_target"
t=$(left); [ "$t" -gt 170 ] && t=170
ab_run cut_1 "$t" --synthetic 4b --slots 1 --modes plain,dflash --tokens 32 --prompt-tokens 64 \
  --runs 3 --values "$V,$V+$NM,$V+$ALL+$SW,$V+$ALL+$SW+$NM,$V+$NR"
sweep_pairs "${ALL//+/ } ${SW//+/ } $NM"
(export HF2Q_NORM_ROPE=1; mkdir -p "$OUT/nr" && OUT="$OUT/nr"
 TL_ARGS="--draft-vocab 32768" timelines 1 90 60 | cut -c1-140 | grep -E "^(==|tl_)|host CUDA API|cudaGraphLaunch")
host_speed
pack_logs
