#!/usr/bin/env bash
# Session 54's second call (after the three keep.sh calls and install.sh), with BUDGET=540, which
# no machine started for; it ran as session 55's run 1 (benchmarks/results/h100/session55/, the
# next call is now h200_s55.sh). Session 54's first call,
# h200_s52.sh PART=2, found MLX's CUDA quantized product wrong for rows of one group (K 64 in
# groups of 64, more than one row), which made the fitted pair's draft-head copy fall back to the
# head on the GPU. This call: the draft head's GPU tests that failed, with the copies now in groups
# of 32 at hidden 64 (target.copy_group); a kernel trace of the one-slot round with the draft
# vocabulary (E 0.716, round 6.05 ms against a 4.34 ms step: where the rest goes); smaller draft
# vocabularies at one slot; then qmm_check --one-group (the other dtypes and widths) in what is left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
t=$(left)
gpu_pytest pytest_head $(( t / 2 < 170 ? t / 2 : 170 )) tests/test_runtime_draft_head.py -k \
  "keeps_greedy_dflash_equal_to_plain or more_rows or one_group or minus_inf"
TL_ARGS="--draft-vocab 32768" timelines 1 70 80
t=$(left)
V0=HF2Q_DRAFT_VOCAB=0 V32=HF2Q_DRAFT_VOCAB=32768 V16=HF2Q_DRAFT_VOCAB=16384 V8=HF2Q_DRAFT_VOCAB=8192
ab_run vocab1d $(( t < 150 ? t : 150 )) --synthetic 4b --modes plain,dflash --tokens 32 \
  --prompt-tokens 64 --runs 3 --values "$V0,$V32,$V16,$V8"
python3 -c "import json; r=json.load(open('$OUT/vocab1d.json')); print(r['dflash_round_ms'], r['E'])"
t=$(left)
[ "$t" -gt 20 ] && { timeout "$t" python3 benchmarks/qmm_check.py --one-group \
  --out "$OUT/qmm_one_group.json" > "$OUT/qmm_one_group.log" 2>&1
  echo "qmm_one_group exit $? $(el)"; cut -c1-200 "$OUT/qmm_one_group.log"; }
host_speed
pack_logs
