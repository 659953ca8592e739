#!/usr/bin/env bash
# Session 25's second H200 call: the fused Gated-DeltaNet kernel writing the conv window
# (HF2Q_GDN_WINDOW, default on: no concatenate, two copy launches, in every layer of every decode
# step and verify). Its CUDA tests with the bf16 exactness tests, then the switch off and on
# alternating in one process (plain_ab.py: plain steps and DFlash rounds of the random 4B-shaped
# pair at 4 and 1 slots, tokens checked equal), the demo bench (trials now round-robin over the
# slot counts), and the 4B-shaped pair at 1-4 slots in what remains.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest t_cuda 150 tests/test_kernels_gated_delta.py tests/test_runtime_bf16_exact.py -m "not slow"
for s in 4 1; do
  t=$(left); [ "$t" -lt 200 ] && break
  ab_run "win_s$s" 90 --synthetic 4b --slots "$s" --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 5 --values HF2Q_GDN_WINDOW=0,HF2Q_GDN_WINDOW=1
done
demo_queue_bench demo-rps4
synthetic_run synthetic 1,2,3,4 "$(left)"
pack_logs
