#!/usr/bin/env bash
# For the next H200 calls (after the three keep.sh calls and install.sh; not yet run: session 41
# was lent no GPU). PART=1 (first call): the drafter's forward as one compiled graph
# (HF2Q_COMPILE_DRAFT, commit ab9efdd, opt-in until measured): its tests on CUDA (bit-equal to
# the fast layers; the bf16 exactness tests' greedy DFlash through it), its host build time
# against the fast layers (forward_build.py --draft), and
# rounds alternating off / on in one process: the 4B-shaped pair's lagged one-slot rounds after
# 1024 positions and the demo pair's synchronous rounds with lookup.
# PART=2: the 4-slot round (issue 5's ratio; session 40: device-bound after the verify graph):
# kernel traces of the 4- and 1-slot rounds (where the 4-slot round's device time goes), the draft
# graph at 4 slots alternating off / on, issue 5's random-pair runs at 1, 4, 8 slots, then the
# final-state Gated-DeltaNet record at one slot after 1024 positions (session 23 found it 10%
# slower when the host built the verify layer by layer). In parts 2 and 3 DRAFT=0/1 sets
# HF2Q_COMPILE_DRAFT for every run that does not set it itself (what part 1 settles).
# PART=3: issue 5's demo-pair queue at 1, 4, 8 slots, then session 41's leftovers (the verify
# graph over a long generation, its tests).
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
  export HF2Q_COMPILE_DRAFT=${DRAFT:-0}  # (the A/B below sets it per run itself)
  timelines "4 1" 100
  ab_run ab_draft_s4 130 --synthetic 4b --slots 4 --modes dflash --tokens 32 --prompt-tokens 64 \
    --runs 3 --env HF2Q_COMPILE_DRAFT --values 0,1
  t=$(left)
  [ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 130 ? t : 130 ))
  t=$(left)
  [ "$t" -gt 100 ] && ab_run ab_record1024 "$t" --synthetic 4b --modes dflash --tokens 48 \
    --prompt-tokens 1024 --runs 3 --env HF2Q_GDN_RECORD --values states,final
  ;;
3)
  export HF2Q_COMPILE_DRAFT=${DRAFT:-0}
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 100 ] && ab_run ab_long $(( t < 150 ? t : 150 )) --synthetic 4b --modes plain,dflash \
    --tokens 512 --prompt-tokens 1024 --runs 2 --env HF2Q_COMPILE_VERIFY --values 0,1
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_graph "$t" -n 2 tests/test_kernels_verify_graph.py \
    tests/test_kernels_forward.py
  ;;
esac
host_speed
pack_logs
