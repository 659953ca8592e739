#!/usr/bin/env bash
# For the next H200 calls (after the three keep.sh calls and install.sh; not yet run: session 41
# was lent no GPU). PART=1 (first call): the drafter's forward as one compiled graph
# (HF2Q_COMPILE_DRAFT, commit ab9efdd, opt-in until measured): its tests on CUDA (bit-equal to
# the fast layers; the bf16 exactness tests' greedy DFlash through it), its host build time
# against the fast layers (forward_build.py --draft), and
# rounds alternating off / on in one process: the 4B-shaped pair's lagged one-slot rounds after
# 1024 positions and the demo pair's synchronous rounds with lookup.
# PART=2: the 4-slot round (issue 5's ratio, session 40: device-bound after the verify graph):
# the draft graph at 4 slots alternating off / on, the final-state Gated-DeltaNet record at one
# slot now that the verify is one graph (session 23 found it 10% slower at one slot when the host
# built the verify layer by layer), and kernel traces of the 1- and 4-slot rounds.
# PART=3: session 41's leftovers (the verify graph over a long generation, its tests) and issue
# 5's headline runs at whatever defaults parts 1-2 settle.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  gpu_pytest pytest_draft_graph 120 -n 2 -k draft tests/test_draft_graph.py \
    tests/test_kernels_row_attention.py
  (export HF2Q_COMPILE_DRAFT=1; gpu_pytest pytest_bf16_draft 100 -n 2 \
    -k "greedy_dflash or lagged" tests/test_runtime_bf16_exact.py)
  timeout 60 python3 benchmarks/forward_build.py --synthetic 4b --draft --reps 50 \
    --out "$OUT/draft_build.json" > "$OUT/draft_build.log" 2>&1
  echo "draft_build exit $? $(el)"; tail -n 1 "$OUT/draft_build.log" | cut -c1-600
  ab_run ab_draft1024 140 --synthetic 4b --modes plain,dflash --tokens 48 --prompt-tokens 1024 \
    --runs 3 --env HF2Q_COMPILE_DRAFT --values 0,1
  t=$(left)
  [ "$t" -gt 60 ] && ab_run ab_draft_demo "$t" --demo --lookup --modes plain,dflash --tokens 128 \
    --runs 3 --env HF2Q_COMPILE_DRAFT --values 0,1
  ;;
2)
  ab_run ab_draft_s4 130 --synthetic 4b --slots 4 --modes dflash --tokens 32 --prompt-tokens 64 \
    --runs 3 --env HF2Q_COMPILE_DRAFT --values 0,1
  ab_run ab_record1024 140 --synthetic 4b --modes dflash --tokens 48 --prompt-tokens 1024 \
    --runs 3 --env HF2Q_GDN_RECORD --values states,final
  (export HF2Q_COMPILE_DRAFT=1; timelines "1 4" 180)
  ;;
3)
  ab_run ab_long 150 --synthetic 4b --modes plain,dflash --tokens 512 --prompt-tokens 1024 \
    --runs 2 --env HF2Q_COMPILE_VERIFY --values 0,1
  gpu_pytest pytest_graph 120 -n 2 tests/test_kernels_verify_graph.py tests/test_kernels_forward.py
  t=$(left)
  [ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 130 ? t : 130 ))
  demo_queue_bench demo_queue
  ;;
esac
host_speed
pack_logs
