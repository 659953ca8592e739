#!/usr/bin/env bash
# Session 32, second GPU call, on the code as it is after run 1's switch was taken out (drafts
# queued ahead as of session 31: not after lookup-only rounds, kept over finished rows, sampled
# rounds too). (1) Issue 5's and 6's runs (hf2q bench on the demo pair at 1, 4, 8 slots with a
# queue; the random 4B-shaped pair at 1 and 4 slots). (2) The GPU tests of drafts queued ahead,
# greedy and sampled, the lookup-only rounds, and the bf16 exactness tests. A fresh machine first
# spends 80-110 s compiling MLX's kernels.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
issue_runs
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest gpu_ahead "$t" tests/test_runtime_lookup.py tests/test_slots_isolation.py \
  tests/test_runtime_bf16_exact.py -k "ahead or skip_the_drafter or sampling_per_slot or bf16"
host_speed
pack_logs
