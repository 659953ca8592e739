#!/usr/bin/env bash
# Session 27, third call, on the one-row scatter default (HF2Q_KV_ROW_SCATTER on CUDA): (1) the
# lagged-row and bf16 exactness tests on the GPU; (2) the 4B-shaped pair at 1-4 slots; (3) the
# demo pair with a queue at 1, 4, 8 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
gpu_pytest t_exact 150 tests/test_slots_cache.py tests/test_runtime_bf16_exact.py -m "not slow" \
  -k "lagged_single_row or exact or lagged_rounds"
synthetic_run synthetic 1,2,3,4 170
demo_queue_bench demo
pack_logs
