#!/usr/bin/env bash
# Session 30, third call: issue 5's and issue 6's runs on this session's code (slot offsets passed
# to the compiled pieces without an AsType copy, the drafter's residuals in its products'
# launches: 241.1 -> 213.5 kernels an 8-slot demo round with the joint write, taken out since).
# (1) hf2q bench on the demo pair at 1, 4, 8 slots with a queue of 4 requests a slot (issue 5: 8
# slots at least 1.5x plain batched); (2) the random 4B-shaped pair at 1 and 4 slots (issue 5: 4
# slots at least 3.2x one slot; issue 6: E at one slot).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
issue_runs
host_speed
pack_logs
