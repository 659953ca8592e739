#!/usr/bin/env bash
# Session 59's measuring call, BUDGET=540: four graph-node cuts, each opt-in.
# - HF2Q_GATED_NORM=1: a Gated-DeltaNet layer's gated norm in one launch (24 nodes fewer in a
#   verify and in a plain step of the 4B shape), built to MLX 0.32's CUDA summation order.
# - HF2Q_ATTN_GATE=1: the attention output gate in the row-invariant attention's store, read
#   from the q projection in place (16 nodes fewer a forward).
# - HF2Q_NORM_ROPE=1: an attention layer's q and k norms with their RoPE in one launch each
#   (the copies around them go too: about 3 nodes a target attention layer, 2 a drafter layer).
# - HF2Q_ACCEPT_KERNEL=1: a greedy round's acceptance and kept counts in one launch (about ten
#   small ops before; round-only nodes).
# (The 1-slot A/B also takes all four with HF2Q_MM_SWIGLU=1 up to 16 rows: 37 nodes fewer a
# 1-slot round, left off at 4 slots where it lost in session 58.)
# Their bits are asked of the GPU first (against mlx-lm's own kernels, and the runners' logits).
# The one-slot round waits for the host (session 57's H100 trace: 6.07 ms against 5.62 busy,
# about 13 us of host a node), so fewer nodes should shorten it; plain steps are the device's.
# Then the goals' sweep at 1 and 4 slots, defaults against all four, alternated.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_pytest cut_bits 130 tests/test_kernels_gated_norm.py tests/test_kernels_accept.py \
  tests/test_kernels_row_attention.py tests/test_kernels_forward.py \
  -k "(cuda and not emulated) or accept or demo_target"
V=HF2Q_DRAFT_VOCAB=32768
GN=HF2Q_GATED_NORM=1
AG=HF2Q_ATTN_GATE=1
NR=HF2Q_NORM_ROPE=1
AK=HF2Q_ACCEPT_KERNEL=1
ALL="$GN+$AG+$NR+$AK"
SW=HF2Q_MM_SWIGLU=1+HF2Q_MM_SWIGLU_ROWS=16  # session 58's SwiGLU launch, one m-tile only
t=$(left); [ "$t" -gt 170 ] && t=170
ab_run cut_1 "$t" --synthetic 4b --slots 1 --modes plain,dflash --tokens 32 --prompt-tokens 64 \
  --runs 3 --values "$V,$V+$ALL,$V+$ALL+$SW,$V+$GN,$V+$AG,$V+$NR"
sweep_pairs "$GN $AG $NR $AK"
# what is left: the one-slot kernel trace with all four (graphs and nodes a round, idle gaps)
(for kv in $GN $AG $NR $AK; do export "${kv?}"; done; mkdir -p "$OUT/cuts" && OUT="$OUT/cuts"
 TL_ARGS="--draft-vocab 32768" timelines 1 90 60 | cut -c1-140 | grep -E "^(==|tl_)|host CUDA API|cudaGraphLaunch")
host_speed
pack_logs
