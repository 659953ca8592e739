#!/usr/bin/env bash
# Written in session 31 for the next GPU call (not run yet). Drafts queued ahead are on by
# default on CUDA since session 31; after its runs they (a) no longer run the drafter ahead of
# a round that follows a lookup-only round (at one slot the batched loop's rounds had been
# 0.7-1.1 ms longer than the single-sequence loop's), (b) survive rows that finish with no
# request waiting, (c) also run in sampled rounds. (1) The A/B at 1 and 8 slots again, alternating
# in one process (session 31 run 1: 1627 / 1601 tok/s at 1 slot, 8186 / 7120 at 8, before (a)
# and (b)); (2) hf2q bench for issue 5; (3) the GPU tests of drafts ahead, greedy and sampled.
# A fresh machine first spends 80-110 s compiling MLX's kernels: the first process has 240 s.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
bench_values ab_ahead 1,8 HF2Q_DRAFT_AHEAD=0,HF2Q_DRAFT_AHEAD=1
demo_queue_bench demo_queue
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest gpu_ahead "$t" tests/test_runtime_lookup.py \
  tests/test_slots_isolation.py -k "ahead or skip_the_drafter or sampling_per_slot"
host_speed
pack_logs
