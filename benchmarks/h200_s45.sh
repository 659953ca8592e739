#!/usr/bin/env bash
# Session 45's device calls (after the three keep.sh calls and install.sh): the final-state
# record's rollback replaying every Gated-DeltaNet layer in one launch (HF2Q_REPLAY_LAYERS, on by
# default on CUDA). In session 44's 4-slot trace the per-layer replays took 0.77 ms of the
# round's 8.52 ms of device time (24 launches, 31 us each).
# PART=1: the replay's tests on the GPU (the kernel against each layer's own replay, the caches'
# one-launch rollback against the per-layer one, the runners' records), the 4-slot round with the
# switch off / on alternating in one process, issue 5's random pair at 1, 4, 8 slots at the new
# defaults, then per-step against final-state records at 1 and 2 slots (where the default is
# still per-step states).
# PART=2: greedy DFlash equal to plain decoding in bf16 with every verify keeping the final state
# (so every rollback goes through the joined replay), the draft graph (HF2Q_COMPILE_DRAFT) off /
# on alternating on hf2q bench's 8-slot demo-pair workload (the 8-slot round is host-bound; the
# graph was only timed at 1 and 4 slots of the 4B-shaped pair), the 4-slot round's kernel trace.
# PART=3: the demo pair's queue at 1, 4, 8 slots.
# PART=4 (after commit 267ddc4: the draft graph on by default, final-state records from 32 MiB a
# layer, so from one slot of the 4B-shaped pair): lagged rounds with two and three rounds in
# flight (HF2Q_LAG_DEPTH) at 1 and 4 slots, the one-slot round's kernel trace with three in
# flight (are the idle gaps after the rollback and after the draft still there?), then issue 5's
# random pair at the new defaults (the
# demo pair's records stay per-step, so run 4's demo queue already measured its defaults).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  gpu_pytest pytest_replay 80 tests/test_kernels_gated_delta.py -k "cuda and (one_launch or replay)"
  gpu_pytest pytest_rollback 150 tests/test_kernels_rollback.py tests/test_runtime_verify_runners.py \
    tests/test_kernels_verify_graph.py
  ab_slots ab_replay "4" HF2Q_REPLAY_LAYERS=0,HF2Q_REPLAY_LAYERS=1
  t=$(left)
  [ "$t" -gt 100 ] && synthetic_run syn4b 1,4,8 $(( t < 130 ? t : 130 ))
  ab_slots ab_record "2 1" HF2Q_GDN_RECORD=states,HF2Q_GDN_RECORD=final
  ;;
2)
  HF2Q_GDN_RECORD=final gpu_pytest pytest_final 150 tests/test_runtime_bf16_exact.py \
    -k "greedy_dflash_equals_plain or lagged_rounds_equal_plain"
  bench_values ab_draft8 8 HF2Q_COMPILE_DRAFT=0,HF2Q_COMPILE_DRAFT=1
  timelines "4" 100 170
  ;;
3)
  demo_queue_bench demo_queue
  ;;
4)
  ab_slots ab_depth "1 4" HF2Q_LAG_DEPTH=2,HF2Q_LAG_DEPTH=3 60
  HF2Q_LAG_DEPTH=3 timelines "1" 250 170
  t=$(left)
  [ "$t" -gt 80 ] && synthetic_run syn4b 1,4,8 $(( t < 140 ? t : 140 ))
  ;;
esac
host_speed
pack_logs
