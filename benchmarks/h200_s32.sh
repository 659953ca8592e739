#!/usr/bin/env bash
# Session 32, first GPU call: the decode loops' graphs encoded on a worker thread
# (HF2Q_ENCODE_THREAD=1, hf2q/evaluation.py) against on the calling thread, alternating in one
# process. (1) The random 4B-shaped pair, one sequence: plain step, DFlash round (lagged) and E
# for each value (issue 6). (2) The same at 4 slots (DFlash rounds). (3) The demo pair's hf2q
# bench workload at 8 and 1 slots (issue 5). (4) The GPU's exactness and lagged/ahead tests with
# the switch on. A fresh machine first spends 80-110 s compiling MLX's kernels.
# Ran once, at commit c8ae7af (session 32 run 1): the switch was slower and crashed a GPU test,
# and was taken out again (docs/BENCHMARKS.md, "H200, session 32"); kept as the record of that run.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
V=HF2Q_ENCODE_THREAD=0,HF2Q_ENCODE_THREAD=1
ab_run enc4b 240 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 64 --runs 5 --values "$V"
ab_slots enc4b_s "4" "$V" 150
t=$(left)
[ "$t" -gt 180 ] && bench_values enc_demo 8,1 "$V"
t=$(left)
[ "$t" -gt 40 ] && HF2Q_ENCODE_THREAD=1 gpu_pytest gpu_enc "$t" tests/test_runtime_bf16_exact.py \
  tests/test_slots_isolation.py tests/test_runtime_lookup.py -k "bf16 or lagged or ahead or skip_the_drafter"
host_speed
pack_logs
