#!/usr/bin/env bash
# Session 51's device calls (after the three keep.sh calls and install.sh).
# PART=1 (BUDGET=560): the draft head's tests first (session 50 run 3 saw
# test_quantized_draft_head_keeps_greedy_dflash_equal_to_plain[4] fail on an H100 with its reason
# lost; HF2Q_TEST_INSTAFAIL now prints it; the draft vocabulary's tests are new), then a draft
# vocabulary (--draft-vocab 32768: the head's 32768 lowest rows, alone and 4-bit) against the
# whole head and its 4-bit copy in one alternation at one slot (E) and at four, then the random
# 4B-shaped pair's slot sweep with the draft vocabulary.
# PART=2 (BUDGET=560): see its comment (written after run 1).
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
  # run 2: MLX's quantized product checked against the dequantized weight's (run 1's failure: a
  # float32 4-bit copy of the fitted pair's head 100% off on the GPU), the one-slot A/B again
  # (run 1's was host-bound: plain steps 4.26-5.54 ms), the draft head's tests with the time
  # they need, then the pair with every draft weight 4-bit and the draft vocabulary.
  timeout 60 python3 benchmarks/qmm_check.py --out "$OUT/qmm_check.json" > "$OUT/qmm_check.log" 2>&1
  echo "qmm_check exit $? $(el)"; cut -c1-1500 "$OUT/qmm_check.log"
  V0=HF2Q_DRAFT_VOCAB=0 V32=HF2Q_DRAFT_VOCAB=32768 B4=HF2Q_DRAFT_HEAD_BITS=4
  t=$(left)
  ab_run vocab1b $(( t < 150 ? t : 150 )) --synthetic 4b --modes plain,dflash --tokens 32 --prompt-tokens 64 --runs "${RUNS:-3}" \
    --values "$V0,$B4,$V32,$V32+$B4"
  python3 -c "import json; r=json.load(open('$OUT/vocab1b.json')); print(r['dflash_round_ms'], r['E'])"
  t=$(left)
  [ "$t" -gt 40 ] && gpu_pytest pytest_head $(( t < 170 ? t : 170 )) tests/test_runtime_draft_head.py
  t=$(left)
  [ "$t" -gt 60 ] && synthetic_run syn4b_draft4_vocab 1,4 "$t" --draft-bits 4 --draft-head-bits 4 \
    --draft-vocab 32768
  ;;
esac
host_speed
pack_logs
