#!/usr/bin/env bash
# Session 23, call 4 (after .device/s2/install.sh): the default Gated-DeltaNet record now keeps the
# final state from 4 verify rows (commit a5a8381). Its GPU tests (the runner verify file whole:
# the unset record at 4 rows and one; the slot isolation file whole: 1-8 slots equal to the single
# runs and plain decoding), then issue 5's runs with it: the random 4B-shaped pair at 1, 4, 8
# slots and the demo pair with a queue at 1, 4, 8 slots (hf2q bench).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest verify_runners 120 tests/test_runtime_verify_runners.py
gpu_pytest slots_isolation 150 tests/test_slots_isolation.py
synthetic_run synthetic 1,4,8 "$(( $(left) - 150 ))"
demo_queue_bench demo-rps4
pack_logs
