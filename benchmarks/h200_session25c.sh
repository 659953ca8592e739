#!/usr/bin/env bash
# Session 25's third H200 call: the conv window as one flat copy over a batch row's blocks (run 2
# found the first version's dependent loads made DFlash rounds slower). The window's CUDA tests,
# the switch off and on alternating in one process (plain_ab.py at 4 and 1 slots), the 4B-shaped
# pair at 1-4 slots, and the demo bench in what remains.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest t_cuda 100 tests/test_kernels_gated_delta.py -m "not slow" -k "window or fused"
for s in 4 1; do
  t=$(left); [ "$t" -lt 150 ] && break
  ab_run "win_s$s" 90 --synthetic 4b --slots "$s" --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 5 --values HF2Q_GDN_WINDOW=0,HF2Q_GDN_WINDOW=1
done
t=$(left); [ "$t" -gt 250 ] && synthetic_run synthetic 1,2,3,4 90
demo_queue_bench demo-rps4
pack_logs
