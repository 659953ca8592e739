#!/usr/bin/env bash
# Session 38, fourth call: why DFlash rounds were slower in the arm with HF2Q_COMPILE_FORWARD=1 in
# two of three plain_ab.py runs (the switch does not touch DFlash's code path): (1) DFlash before
# plain decoding in each arm (a DFlash run then follows the other arm's plain run), (2) DFlash
# alone, the switch off / on alternating; bf16 4B-shaped pair after 1024 prompt tokens.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
ab_run ab_dfirst 200 --synthetic 4b --modes dflash,plain --tokens 64 --prompt-tokens 1024 --runs 5 \
  --env HF2Q_COMPILE_FORWARD --values 0,1
t=$(left)
[ "$t" -gt 60 ] && ab_run ab_donly "$t" --synthetic 4b --modes dflash --tokens 64 \
  --prompt-tokens 1024 --runs 5 --env HF2Q_COMPILE_FORWARD --values 0,1
host_speed
pack_logs
