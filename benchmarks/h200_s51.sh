#!/usr/bin/env bash
# Session 51's device calls (after the three keep.sh calls and install.sh).
# PART=1 (BUDGET=560): the draft head's tests first (session 50 run 3 saw
# test_quantized_draft_head_keeps_greedy_dflash_equal_to_plain[4] fail on an H100 with its reason
# lost; HF2Q_TEST_INSTAFAIL now prints it; the draft vocabulary's tests are new), then a draft
# vocabulary (--draft-vocab 32768: the head's 32768 lowest rows, alone and 4-bit) against the
# whole head and its 4-bit copy in one alternation at one slot (E) and at four, then the random
# 4B-shaped pair's slot sweep with the draft vocabulary.
# PART=2 (BUDGET=560): the slot sweep at the defaults and the demo pair's queue (issue 5's rows),
# verify-16 / decode-1 (verify_cost.py), then the GPU tests of the fidelity, slot isolation and
# kernels with the time left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${PART:-1}" in
1)
  gpu_pytest pytest_head 110 tests/test_runtime_draft_head.py
  V0=HF2Q_DRAFT_VOCAB=0 V32=HF2Q_DRAFT_VOCAB=32768 B4=HF2Q_DRAFT_HEAD_BITS=4
  ab_run vocab1 170 --synthetic 4b --modes plain,dflash --tokens 32 --prompt-tokens 64 --runs 3 \
    --values "$V0,$B4,$V32,$V32+$B4"
  ab_slots vocab "4" "$V0,$V32,$V32+$B4" 100
  t=$(left)
  [ "$t" -gt 60 ] && synthetic_run syn4b_vocab 1,4,8 "$t" --draft-vocab 32768
  ;;
2)
  synthetic_run syn4b 1,4,8 170
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 80 ] && timeout 120 python3 benchmarks/verify_cost.py --dtypes bf16 \
    --paths runtime,runtime-whole --reps 9 --no-profile --out "$OUT/verify_cost.json" \
    > "$OUT/verify_cost.log" 2>&1
  echo "verify_cost exit $? $(el)"; grep -A3 "^path " "$OUT/verify_cost.log" | cut -c1-200
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_gpu "$t" tests/test_runtime_fidelity.py \
    tests/test_slots_isolation.py tests/test_runtime_bf16_exact.py tests/test_kernels_gated_delta.py \
    tests/test_kernels_qmatmul.py -k "cuda or greedy or tokens or equal"
  ;;
esac
host_speed
pack_logs
