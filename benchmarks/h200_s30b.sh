#!/usr/bin/env bash
# Session 30, second call: fewer drafter nodes a round (commits 64b88ca and 31edc89: slot offsets passed
# to the compiled pieces without an AsType copy, the drafter's residuals in its products' launches,
# and HF2Q_DRAFT_JOINT: a slot row's context and block in one trace and one write a layer).
# (1) hf2q bench's workload (demo pair, built-in prompts, 4 requests a slot, 128 tokens, lookup)
# with HF2Q_DRAFT_JOINT=0,1 alternating in one process at 8 and 1 slots; (2) the 8-slot kernel
# trace again (run 1 before these commits: DFlash 241.1 kernels a round, plain 127.2); (3) the
# drafter fast-path tests on the real kernels.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
bench_values ab_joint 8,1 HF2Q_DRAFT_JOINT=0,HF2Q_DRAFT_JOINT=1
demo_timeline tl_demo8 12
t=$(left)
[ "$t" -gt 30 ] && gpu_pytest gpu_drafter "$t" tests/test_kernels_row_attention.py -k "drafter or cuda_kernel"
pack_logs
