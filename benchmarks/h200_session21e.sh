#!/usr/bin/env bash
# H200 call 5 of session 21 (after .device/s2/install.sh): call 4 found the 4B-shaped round at 2
# slots 0.5 ms over 1 slot, at 3 slots 4.3 ms over 2; from 3 slots (48 draft rows) the drafter runs
# on cuBLAS (HF2Q_DRAFT_MM_ROWS=32, chosen in session 19 against the older launches). Drafts of up
# to 64 rows on the kernel against the default, alternating in one process, at 4 then 3 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
for s in 4 3; do
  t=$(left); [ "$t" -lt 50 ] && break
  ab_run "draft_rows_s$s" "$t" --synthetic 4b --slots "$s" --modes dflash --tokens 32 \
    --prompt-tokens 64 --runs 3 --values HF2Q_DRAFT_MM_ROWS=32,HF2Q_DRAFT_MM_ROWS=64
done
pack_logs
