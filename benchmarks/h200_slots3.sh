#!/usr/bin/env bash
# For the next H200 call (after .device/s2/install.sh; not yet run on a GPU): why does a batched
# step cost more from three rows on? Session 21 (runs 2 and 5) timed the 4B-shaped pair's plain
# batched step at 3.79-4.20 / 4.08 / 4.81-5.40 / 5.01-5.08 / 5.09-5.14 ms at 1 / 2 / 3 / 4 / 8 slots
# and the DFlash round at 8.69 / 9.19 / 13.45 / 13.43 ms at 1-4 slots, although a plain step's
# products run one m-tile at every slot count. This turns the CUDA kernels off one at a time
# (alternating in one process per slot count, plain_ab.py), at 2 and 3 slots (then 4 and 1 in the
# time left): the component whose cost steps up at three rows is the one whose switch removes the
# step. SHAPE=small runs the same on a CPU (a check of the script).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
V="HF2Q_KERNELS=auto,HF2Q_ROW_ATTENTION=0,HF2Q_GROUPED_MM=0,HF2Q_SMALL_MM=0,HF2Q_KERNELS=ops"
for s in 2 3 4 1; do
  t=$(left); [ "$t" -lt 60 ] && break
  ab_run "kernels_s$s" "$t" --synthetic "${SHAPE:-4b}" --slots "$s" --modes plain,dflash \
    --tokens 32 --prompt-tokens 64 --runs 3 --values "$V"
done
pack_logs
