#!/usr/bin/env bash
# H200 call 3 of session 21 (after .device/s2/install.sh): call 1's launch tune again with the
# kinds taking turns within each rep (call 1 timed each launch's reps back to back, in order, and
# the default, timed first, was often faster than the same launch timed later as a candidate).
# Twelve launch shapes at 32-128 rows of the 4B shapes, row blocks among them, 15 reps. (At
# commit 3044a2d, where this ran, a fourth value meant the m-tiles of a thread block; since
# 318a4dd it means weight stages, so rerun at 3044a2d to repeat this call.)
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
C="4,8,4;8,8,4;8,8,1;4,8,1;8,8,2,2;8,8,4,2;4,8,4,2;8,8,1,2;4,8,2,2;8,8,1,1;4,8,1,4;8,8,2,4"
tune_turns tune "$C" 64,48 128,32
pack_logs
