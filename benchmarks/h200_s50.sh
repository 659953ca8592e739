#!/usr/bin/env bash
# Session 50's device calls (after the three keep.sh calls and install.sh).
# PART=1 (BUDGET=560): issues 5's and 6's goals where they are set, if the machine is an H200 (the
# first since session 44): the random 4B-shaped pair at 1, 4, 8 slots (E, four slots against one),
# the demo pair's queue at 1, 4, 8 slots (eight slots against plain batched), verify-16 / decode-1
# and decode against the bandwidth floor (verify_cost.py, call by call), then the same slot sweep
# with drafts from a 4-bit copy of the head (--draft-head-bits 4) in what is left.
# PART=2 (BUDGET=450): session 49's pending PART=2 (the draft head's A/Bs after its fixes at four
# and one slots), then the Gated-DeltaNet CUDA tests and the greedy fidelity tests with the time left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${PART:-1}" in
1)
  synthetic_run syn4b 1,4,8 200
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 60 ] && timeout $(( t < 120 ? t : 120 )) python3 benchmarks/verify_cost.py --dtypes bf16 \
    --paths runtime,runtime-whole --reps 9 --no-profile --out "$OUT/verify_cost.json" \
    > "$OUT/verify_cost.log" 2>&1
  echo "verify_cost exit $? $(el)"; grep -A3 "^path " "$OUT/verify_cost.log" | cut -c1-200
  t=$(left)
  [ "$t" -gt 80 ] && (export HF2Q_DRAFT_HEAD_BITS=4; synthetic_run syn4b_head4 1,4,8 "$t")
  ;;
2)
  heads=HF2Q_DRAFT_HEAD_BITS=0,HF2Q_DRAFT_HEAD_BITS=8,HF2Q_DRAFT_HEAD_BITS=4
  ab_run ab_head4 90 --synthetic 4b --slots 4 --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 2 --values "$heads"
  t=$(left)
  [ "$t" -gt 50 ] && ab_run ab_head1 $(( t < 90 ? t : 90 )) --synthetic 4b --modes plain,dflash \
    --tokens 32 --prompt-tokens 64 --runs 2 --values "$heads"
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_gpu "$t" tests/test_kernels_gated_delta.py \
    tests/test_runtime_fidelity.py tests/test_runtime_draft_head.py -k "cuda or greedy or tokens"
  ;;
esac
host_speed
pack_logs
