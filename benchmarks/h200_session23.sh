#!/usr/bin/env bash
# Session 23, call 1 (after .device/s2/install.sh; h200_session23b.sh is call 2): session 22 made lagged rounds
# queue their draft first and their verify every 8 layers by default (commit 474d68e) and removed
# the staged-weights option (dde0e27, the kernel source as the GPU ran it through session 21),
# with no device time left to run the GPU tests. First those tests (greedy bf16 DFlash equal to
# plain decoding on CUDA, lagged slots equal to the single runs, queued verifies bit-equal, the
# product kernel's bits, the recurrence kernel's per-row replay), the Gated-DeltaNet record's
# two ways timed (benchmarks/gdn_record_cost.py) and HF2Q_GDN_RECORD=final end to end at 4 and 8
# slots, then issue 5's runs with the new defaults: the
# random 4B-shaped pair at 1-8 slots, the demo pair's 8-slot rounds with lagged lookup rounds or
# the verify queued every 4 layers (alternating in one process), and the demo pair with a queue.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest exact_tests 150 tests/test_runtime_bf16_exact.py tests/test_runtime_flush.py
gpu_pytest lagged_slots 100 tests/test_slots_isolation.py -k "lagged or sampling"
gpu_pytest matmul_tests 100 tests/test_kernels_matmul.py -k cuda
gpu_pytest gdn_tests 100 tests/test_kernels_gated_delta.py -k "cuda or replay"
# The Gated-DeltaNet record: per-step states + one copying rollback launch (the runtime's) against
# the final state + a replay of each row's kept steps, 24 layers of the 4B shape, 1 / 4 / 8 rows.
timeout 120 python3 benchmarks/gdn_record_cost.py --rows 1,4,8 --reps 20 --out "$OUT/gdn_record.json" \
  > "$OUT/gdn_record.log" 2>&1
echo "gdn_record exit $? $(el)"; tail -n 4 "$OUT/gdn_record.log"
# HF2Q_GDN_RECORD=final end to end (not a default): its GPU tests, then the 4B-shaped pair's
# rounds at 4 and 8 slots with either record, alternating in one process.
gpu_pytest record_tests 150 tests/test_runtime_verify_runners.py -k "final or record"
ab_slots record_s "4 8" "HF2Q_GDN_RECORD=states,HF2Q_GDN_RECORD=final"
pack_logs
