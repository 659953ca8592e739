#!/usr/bin/env bash
# For the next H200 call (after the three keep.sh calls and install.sh; not yet run). What session
# 39 left open: (1) the narrow one-m-tile product launch (HF2Q_MM_NARROW, opt-in) against the
# default, alternating in one process, at 1024 positions (session 39: 10-16% faster launch by
# launch in kernel traces, yet run 4 with it on was 1-3 ms slower at one m-tile on another
# machine); (2) the GPU tests that did not run at session 39's final defaults (the compiled step,
# greedy fidelity, slot isolation, quantized targets); (3) issue 5's headline runs at the
# defaults: the bf16 4B-shaped pair at 1, 4, 8 slots and the demo pair through hf2q bench.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
ab_run ab_narrow1024 120 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 1024 \
  --runs 5 --env HF2Q_MM_NARROW --values 0,1
gpu_pytest pytest_defaults 200 tests/test_kernels_forward.py tests/test_runtime_fidelity.py \
  tests/test_slots_isolation.py tests/test_kernels_qmatmul.py
t=$(left)
[ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 150 ? t : 150 ))
demo_queue_bench demo_queue
host_speed
pack_logs
