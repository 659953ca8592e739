#!/usr/bin/env bash
# Session 31, second call: issue 5's and issue 6's runs with drafts queued ahead on by default on
# CUDA (run 1: hf2q bench's demo workload at 8 slots 8185 against 7120 tok/s, rounds 4.21 against
# 4.84 ms). (1) hf2q bench on the demo pair at 1, 4, 8 slots with a queue of 4 requests a slot
# (issue 5: 8 slots at least 1.5x plain batched); (2) the random 4B-shaped pair at 1 and 4 slots
# (issue 5: 4 slots at least 3.2x one slot; issue 6: E at one slot); (3) the drafts-ahead tests
# on the GPU (plain greedy tokens with a queue, blocks of 16 and 4).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
issue_runs
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest gpu_ahead "$t" tests/test_runtime_lookup.py -k ahead
host_speed
pack_logs
