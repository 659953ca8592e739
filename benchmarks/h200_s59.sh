#!/usr/bin/env bash
# Session 59's measuring call, BUDGET=540: two round-node cuts, both opt-in.
# - HF2Q_GATED_NORM=1: a Gated-DeltaNet layer's gated norm in one launch (24 nodes fewer in a
#   verify and in a plain step of the 4B shape), built to MLX 0.32's CUDA order: its bits are
#   asked of the GPU first (mlx-lm's rms_norm + precise_swiglu, and the runners' logits).
# - HF2Q_ACCEPT_KERNEL=1: a greedy round's acceptance and kept counts in one launch (about ten
#   small ops before; round-only nodes).
# The one-slot round waits for the host (session 57's H100 trace: 6.07 ms against 5.62 busy,
# about 13 us of host a node), so fewer nodes should shorten it; plain steps are the device's.
# Then the goals' sweep at 1 and 4 slots, defaults against both cuts, alternated.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
gpu_pytest cut_bits 110 tests/test_kernels_gated_norm.py tests/test_kernels_accept.py -k "(cuda and not emulated) or accept"
V=HF2Q_DRAFT_VOCAB=32768
GN=HF2Q_GATED_NORM=1
AK=HF2Q_ACCEPT_KERNEL=1
t=$(left); [ "$t" -gt 160 ] && t=160
ab_run cut_1 "$t" --synthetic 4b --slots 1 --modes plain,dflash --tokens 32 --prompt-tokens 64 \
  --runs 5 --values "$V,$V+$GN,$V+$AK,$V+$GN+$AK"
ab_slots cut_ "4" "$V,$V+$GN+$AK"
for r in a b; do
  for g in default cuts; do
    t=$(left); [ "$t" -lt 60 ] && break 2
    [ "$t" -gt 110 ] && t=110
    settings=""; [ "$g" = cuts ] && settings="$GN $AK"
    (for kv in $settings; do export "${kv?}"; done
     synthetic_run "syn4b_${g}_$r" 1,4 "$t" --draft-vocab 32768)
  done
done
host_speed
pack_logs
