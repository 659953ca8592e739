#!/usr/bin/env bash
# Session 26, third call, on the new defaults (the column split for heads, HF2Q_MM_COLUMNS=1; a
# drafter's layers on the kernel up to 64 rows, HF2Q_DRAFT_MM_ROWS=64, its head up to 32):
# (1) the 4-slot round against the old settings alternating in one process; (2) the bf16
# exactness tests; (3) the 4B-shaped pair at 1-4 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
ab_run s4_new 110 --synthetic 4b --slots 4 --modes dflash --tokens 32 --prompt-tokens 64 --runs 5 \
  --values "HF2Q_MM_COLUMNS=0+HF2Q_DRAFT_MM_ROWS=32,HF2Q_MM_COLUMNS=1+HF2Q_DRAFT_MM_ROWS=64"
gpu_pytest t_exact 80 tests/test_runtime_bf16_exact.py -m "not slow" -k "exact"
t=$(left); [ "$t" -gt 90 ] && synthetic_run synthetic 1,2,3,4 "$(( t - 10 ))"
pack_logs
