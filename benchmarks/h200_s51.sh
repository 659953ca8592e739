#!/usr/bin/env bash
# The next session's device calls (after the three keep.sh calls and install.sh).
# PART=1 (BUDGET=560): first the quantized draft head's tests (session 50 run 3 saw
# test_quantized_draft_head_keeps_greedy_dflash_equal_to_plain[4] fail on an H100 with its reason
# lost; HF2Q_TEST_INSTAFAIL now prints it), then issues 5's and 6's runs: the random 4B-shaped
# pair at 1, 4, 8 slots and the demo pair's queue; then the pair at 1 and 4 slots with every
# drafter weight and the draft head 4-bit (--draft-bits 4, HF2Q_DRAFT_HEAD_BITS=4: drafts only
# read them, the output is the target's) in what is left.
# PART=2 (BUDGET=450): verify-16 / decode-1 and decode against the bandwidth floor (verify_cost.py,
# call by call), then the GPU tests of the fidelity, slot isolation and kernels with the time left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${PART:-1}" in
1)
  gpu_pytest pytest_head 100 tests/test_runtime_draft_head.py
  synthetic_run syn4b 1,4,8 200
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 80 ] && timeout "$t" python3 benchmarks/slots_synthetic.py \
    --shape 4b --slots 1,4 --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 \
    --draft-bits 4 --draft-head-bits 4 --out "$OUT/syn4b_draft4.json" > "$OUT/syn4b_draft4.log" 2>&1
  echo "syn4b_draft4 exit $? $(el)"
  [ -f "$OUT/syn4b_draft4.json" ] && python3 benchmarks/bench_rows.py "$OUT/syn4b_draft4.json"
  ;;
2)
  timeout 150 python3 benchmarks/verify_cost.py --dtypes bf16 --paths runtime,runtime-whole \
    --reps 9 --no-profile --out "$OUT/verify_cost.json" > "$OUT/verify_cost.log" 2>&1
  echo "verify_cost exit $? $(el)"; grep -A3 "^path " "$OUT/verify_cost.log" | cut -c1-200
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_gpu "$t" tests/test_runtime_fidelity.py \
    tests/test_slots_isolation.py tests/test_runtime_bf16_exact.py tests/test_kernels_gated_delta.py \
    tests/test_kernels_qmatmul.py -k "cuda or greedy or tokens or equal"
  ;;
esac
host_speed
pack_logs
