#!/usr/bin/env bash
# Session 58's first call on a lease (after the three keep.sh calls and install.sh), BUDGET=540;
# benchmarks/h200_s58b.sh (session 57's staged questions) is the second.
# The question: the one-slot round is the host's (session 57, H100: 6.07 ms against 5.62 busy,
# 537 nodes a round), and 37 of its nodes are the MLPs' SwiGLU elementwise kernels.
# HF2Q_MM_SWIGLU=1 computes gate, up and SwiGLU in one launch (acd2a59; the bits of the grouped
# launch and mlx-lm's swiglu, which the first tests check on this GPU). Then the plain step and
# the one-slot round with it off and on, alternating in one process (E from the same run), the
# 4-slot round likewise (with HF2Q_MM_COLS64=2x4x3, x copied ahead, alone and with it), and the
# goals' sweep at 1 and 4 slots, one process each, alternated twice.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_pytest swiglu_bits 100 tests/test_kernels_matmul.py -k "cuda and swiglu"
V=HF2Q_DRAFT_VOCAB=32768
ab_run sw_1 "$(left)" --synthetic 4b --slots 1 --modes plain,dflash --tokens 32 --prompt-tokens 64 \
  --runs 3 --values "$V+HF2Q_MM_SWIGLU=0,$V+HF2Q_MM_SWIGLU=1"
gpu_pytest cols64_bits 90 tests/test_kernels_matmul.py -k "cuda_cols64"
ab_slots sw_ "4" "$V+HF2Q_MM_SWIGLU=0,$V+HF2Q_MM_SWIGLU=1,$V+HF2Q_MM_COLS64=2x4x3,$V+HF2Q_MM_SWIGLU=1+HF2Q_MM_COLS64=2x4x3"
for r in a b; do
  for g in 0 1; do
    t=$(left); [ "$t" -lt 60 ] && break 2
    [ "$t" -gt 110 ] && t=110
    HF2Q_MM_SWIGLU=$g synthetic_run "syn4b_sw${g}_$r" 1,4 "$t" --draft-vocab 32768
  done
done
host_speed
pack_logs
