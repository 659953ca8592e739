#!/usr/bin/env bash
# Session 52's device calls (after the three keep.sh calls and install.sh): session 51's PART=2,
# which never ran, with the draft vocabulary's widening timed first.
# PART=1 (BUDGET=560): MLX's quantized product against the dequantized weight's (session 51's
# failure: a float32 4-bit copy of the fitted pair's head 100% off on an H100), the widening's
# cost next to the K rows' product (widen_cost.py: session 51's four-slot rounds gained 0.09 ms
# at K 32768 where the head bytes not read should save about 0.3), the one-slot A/B of the draft
# vocabulary again (session 51's was host-bound) with a 4-bit copy of the drafter alternating
# (plain_ab.py's AB_DRAFT_BITS), the pair with every draft weight 4-bit and the draft vocabulary
# at one and four slots, then the draft head's tests in what is left.
# PART=2 (BUDGET=560), for the next lease: see its comment.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${PART:-1}" in
1)
  timeout 45 python3 benchmarks/qmm_check.py --out "$OUT/qmm_check.json" > "$OUT/qmm_check.log" 2>&1
  echo "qmm_check exit $? $(el)"; grep -v '"rel_err": 0.0[0-9]' "$OUT/qmm_check.log" | cut -c1-1500
  t=$(left)
  timeout $(( t < 60 ? (t > 5 ? t : 5) : 60 )) python3 benchmarks/widen_cost.py --out "$OUT/widen_cost.json" > "$OUT/widen_cost.log" 2>&1
  echo "widen_cost exit $? $(el)"; cut -c1-120 "$OUT/widen_cost.log"
  V0=HF2Q_DRAFT_VOCAB=0 V32=HF2Q_DRAFT_VOCAB=32768 B4=HF2Q_DRAFT_HEAD_BITS=4 D4=AB_DRAFT_BITS=4
  t=$(left)
  ab_run vocab1b $(( t < 150 ? t : 150 )) --synthetic 4b --modes plain,dflash --tokens 32 --prompt-tokens 64 --runs "${RUNS:-3}" \
    --values "${VALS:-$V0,$B4,$V32+$B4,$D4+$B4,$D4+$V32+$B4}"
  python3 -c "import json; r=json.load(open('$OUT/vocab1b.json')); print(r['dflash_round_ms'], r['E'])"
  t=$(left)
  [ "$t" -gt 60 ] && synthetic_run syn4b_draft4_vocab 1,4 $(( t < 200 ? t : 200 )) --draft-bits 4 \
    --draft-head-bits 4 --draft-vocab 32768
  t=$(left)
  [ "$t" -gt 40 ] && gpu_pytest pytest_head "$t" tests/test_runtime_draft_head.py
  ;;
2)
  # For the next lease (BUDGET=560): the draft vocabulary with greedy drafts mapped, not widened
  # (184fb43), against the whole head and the 4-bit copy at one slot (E) and four, the slot
  # sweep with it, MLX's quantized product checked with the time it needs, the head's tests.
  V0=HF2Q_DRAFT_VOCAB=0 V32=HF2Q_DRAFT_VOCAB=32768 B4=HF2Q_DRAFT_HEAD_BITS=4
  ab_run vocab1c 170 --synthetic 4b --modes plain,dflash --tokens 32 --prompt-tokens 64 \
    --runs "${RUNS:-3}" --values "${VALS:-$V0,$B4,$V32,$V32+$B4}"
  python3 -c "import json; r=json.load(open('$OUT/vocab1c.json')); print(r['dflash_round_ms'], r['E'])"
  ab_slots vocabm "4" "$V0,$B4,$V32,$V32+$B4" 100
  t=$(left)
  [ "$t" -gt 60 ] && synthetic_run syn4b_vocabm 1,4,8 $(( t < 170 ? t : 170 )) --draft-vocab 32768
  t=$(left)
  [ "$t" -gt 30 ] && { timeout $(( t < 90 ? t : 90 )) python3 benchmarks/qmm_check.py \
    --out "$OUT/qmm_check.json" > "$OUT/qmm_check.log" 2>&1
    echo "qmm_check exit $? $(el)"; tail -n 1 "$OUT/qmm_check.log" | cut -c1-1500; }
  t=$(left)
  [ "$t" -gt 40 ] && gpu_pytest pytest_head "$t" tests/test_runtime_draft_head.py
  ;;
esac
host_speed
pack_logs
