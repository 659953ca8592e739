#!/usr/bin/env bash
# Session 28, one call: (1) session 27's three GPU failures of the ragged-rollback test, once with the
# one-row write as a slice (HF2Q_KV_ROW_SCATTER=0) and once on the default (scatter on CUDA), each
# failure's message shown; (2) the two bf16 lagged-round exactness tests that session 27's call ran
# out of time for. PART=tests runs these; PART=speed runs the 4B-shaped pair at 1-4 slots and the
# demo pair with a queue at 1, 4, 8 slots on the default (session 27's third call, whose files
# were lost).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
if [ "${PART:-tests}" = tests ]; then
  for v in 0 1; do
    HF2Q_KV_ROW_SCATTER=$v gpu_pytest "t_ragged$v" 150 tests/test_slots_cache.py -k ragged_rollback
    grep -E "^E .*(Max abs|Max rel|Mismatched|row [0-9]|AssertionError)" "$OUT/t_ragged$v.log" | head -n 24
  done
  gpu_pytest t_lagged "$(left)" tests/test_runtime_bf16_exact.py -k lagged_rounds
else
  synthetic_run synthetic 1,2,3,4 170
  demo_queue_bench demo
fi
pack_logs
