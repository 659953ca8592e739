#!/usr/bin/env bash
# Session 39, last call, at the session's final kernels (attention loads issued early, two heads a
# block, one-thread-an-element merge; single-weight one-m-tile products below 264 four-column
# blocks at one column block unrolled twice): (1) the GPU tests of the products, the compiled
# step, greedy fidelity and slot isolation; (2) plain and DFlash decoding at 1024 positions
# (plain_ab.py); (3) the headline runs of issue 5: the bf16 4B-shaped pair at 1, 4, 8 slots and
# the demo pair through hf2q bench with a queue. (After this run the narrow launch became opt-in:
# HF2Q_MM_NARROW=1 reproduces run 4's setting.)
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
gpu_pytest pytest_final 170 tests/test_kernels_matmul.py tests/test_kernels_forward.py \
  tests/test_runtime_fidelity.py tests/test_slots_isolation.py
ab_run ab1024 90 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 1024 --runs 5
t=$(left)
[ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 150 ? t : 150 ))
t=$(left)
[ "$t" -gt 80 ] && demo_queue_bench demo_queue
host_speed
pack_logs
