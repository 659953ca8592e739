#!/usr/bin/env bash
# For the next H200 call (after the three keep.sh calls and install.sh; not yet run). What session
# 40 left open: (1) the verify graph over a long generation, where its KV buffers grow (the graphs
# now grow them by at least 1024 positions, graph_capacity; session 40's A/Bs replayed one trace),
# alternating with the layer path in one process: one-slot rounds after 1024 positions, 512 new
# tokens; (2) the verify graph's own tests on CUDA (session 40 ran the bf16 exactness tests
# through it, not this file to the end); (3) where the 4-slot round goes now that the host builds
# it faster (its wait for the device doubled: a kernel trace); (4) issue 5's headline runs.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
ab_run ab_long 150 --synthetic 4b --modes plain,dflash --tokens 512 --prompt-tokens 1024 --runs 2 \
  --env HF2Q_COMPILE_VERIFY --values 0,1
gpu_pytest pytest_graph 120 -n 2 tests/test_kernels_verify_graph.py tests/test_kernels_forward.py
timelines "4" 200
t=$(left)
[ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 130 ? t : 130 ))
demo_queue_bench demo_queue
host_speed
pack_logs
