#!/usr/bin/env bash
# Session 31, third call, drafts queued ahead on by default on CUDA. (1) hf2q bench on the demo
# pair at 1, 4, 8 slots again (issue 5's 8-slot goal: 1.53x in run 2; one run is one host);
# (2) a kernel trace of the demo pair's 8-slot round with lookup (session 30: wall 5.15 ms,
# device busy 1.75, the largest idle gap 0.9-1.4 ms where the next draft was built after the
# read); (3) the lookup tests on the GPU (synchronous rounds now draft ahead there by default).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
demo_queue_bench demo_queue
demo_timeline tl_demo8 45
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest gpu_lookup "$t" tests/test_runtime_lookup.py
host_speed
pack_logs
