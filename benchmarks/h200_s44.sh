#!/usr/bin/env bash
# Session 44's device calls (after the three keep.sh calls and install.sh), on the tree after the
# K-split's revert (d67a059). Session 44's first call ran h200_s42.sh PART=2 with the draft graph
# on; its two kernel traces were cut off at 80 s with nothing in their logs (a slower host: 0.97 s
# a 1e7-add loop).
# PART=1: issue 5's demo-pair queue at 1, 4, 8 slots at the shipped defaults (the draft graph off),
# the draft graph alternating off / on on the demo pair at one slot with lookup (h200_s42.sh
# PART=1's last A/B, never run), then the 4-slot round's kernel trace with 170 s to finish.
# PART=2: the verify graph over a long generation (ab_long) and its CUDA tests (h200_s42.sh
# PART=3's leftovers), then the 1-slot round's kernel trace.
# PART=3 (when an H200 comes with one call's time left): issue 5's runs on it at the shipped
# defaults, the demo-pair queue and the random pair at 1, 4, 8 slots, then the 4-slot trace.
# PART=4 (its next call): the demo pair's 8-slot queue again (PART=3 ran on a host that took
# 1.51 s), the 1-slot trace, the verify graph's tests.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 80 ] && ab_run ab_draft_demo $(( t < 150 ? t : 150 )) --demo --lookup \
    --modes plain,dflash --tokens 128 --runs 3 --env HF2Q_COMPILE_DRAFT --values 0,1
  timelines "4" 100 170
  ;;
2)
  t=$(left)
  [ "$t" -gt 100 ] && ab_run ab_long $(( t < 150 ? t : 150 )) --synthetic 4b --modes plain,dflash \
    --tokens 512 --prompt-tokens 1024 --runs 2 --env HF2Q_COMPILE_VERIFY --values 0,1
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_graph $(( t < 150 ? t : 150 )) -n 2 \
    tests/test_kernels_verify_graph.py tests/test_kernels_forward.py
  timelines "1" 100 170
  ;;
3)
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 130 ? t : 130 ))
  timelines "4" 100 170
  ;;
4)
  demo_queue_bench demo_queue8 8
  timelines "1" 60 100
  t=$(left)
  [ "$t" -gt 40 ] && gpu_pytest pytest_graph "$t" -n 2 tests/test_kernels_verify_graph.py
  ;;
esac
host_speed
pack_logs
