#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): launch shapes for the tied 2560 x 248320 head.
# Session 22's kernel traces (h200_timeline2.sh) timed the verify's head product through the kernel
# at 581 us for 64 rows and 924 us for 128, where cuBLAS ran the drafter's 64- and 128-row head in
# 305 / 338 us in the same rounds (weight read floor about 265 us): with 7760 column blocks of 32
# columns each block re-reads the whole input from L2 (2.5 GB at 64 rows). Wider blocks cut that.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
C="4,8,1;4,8,4;8,8,1;8,8,2;8,8,4;16,8,1;16,8,4;32,8,1;2,8,1"
SHAPES=head4b tune_turns head "$C" 64,128 16,32,48
pack_logs
