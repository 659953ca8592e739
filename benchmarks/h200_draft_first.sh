#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): does queuing a lagged round's draft before its
# verify is built (HF2Q_LAGGED_DRAFT_FIRST=1), and the verify every 8 layers on top
# (HF2Q_FLUSH_LAYERS=8), shorten the random 4B-shaped pair's rounds? Session 22's kernel traces
# found the device idle 2.0 ms a round at one slot and 3-4 ms at four at the round boundary.
# plain_ab.py alternates the settings in one process, at 4 slots, then 1.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
V="HF2Q_LAGGED_DRAFT_FIRST=0,HF2Q_LAGGED_DRAFT_FIRST=1,HF2Q_LAGGED_DRAFT_FIRST=1+HF2Q_FLUSH_LAYERS=8"
ab_slots draft_first_s "4 1" "$V" 45
pack_logs
