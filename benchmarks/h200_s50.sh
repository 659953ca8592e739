#!/usr/bin/env bash
# Session 50's device calls (after the three keep.sh calls and install.sh).
# PART=1 (BUDGET=560): issues 5's and 6's goals where they are set, if the machine is an H200 (the
# first since session 44): the random 4B-shaped pair at 1, 4, 8 slots (E, four slots against one),
# the demo pair's queue at 1, 4, 8 slots (eight slots against plain batched), verify-16 / decode-1
# and decode against the bandwidth floor (verify_cost.py, call by call), then the same slot sweep
# with drafts from a 4-bit copy of the head (--draft-head-bits 4) in what is left.
# PART=3 (BUDGET=200): the 4-bit head's launches at 60 and 15 rows, longer.
# PART=2 (BUDGET=560): the 4-bit draft head's kernel launches timed in turn (quant_rows.py --tune:
# wider column blocks, the column split), then session 49's pending A/Bs of the draft head at four
# and one slots with the fastest launch as a fourth value, then the GPU tests with the time left.
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
  # the 4-bit head's launches at a draft's rows (one slot, four): the default K-split, wider
  # column blocks, the column split (x staged once a block); then the fastest of each end to end
  # (run 1, commit 31d07b9: 15 rows then 60 in 90 s, cut after 15 on a slow host; now 60 first)
  timeout 170 python3 benchmarks/quant_rows.py --shapes head --bits 4 --rows 60,15 --ops 2 --reps 7 \
    --tune "8,4,1;16,4,1;8,8,1;4,4,1;2,8,1,8;1,8,1,8;2,4,1,8;4,4,1,4;4,8,1,8" \
    --out "$OUT/qtune.json" > "$OUT/qtune.log" 2>&1
  echo "qtune exit $? $(el)"; cat "$OUT/qtune.log" | cut -c1-400
  best() {  # the fastest kernel launch at $1 rows in qtune.json, as HF2Q_QMM_LAUNCH wants it
    python3 - "$OUT/qtune.json" "$1" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["tune"] if r["rows"] == int(sys.argv[2])]
us = {k: v for k, v in rows[0]["us"].items() if k not in ("mlx",)} if rows else {}
k = min(us, key=us.get) if us else "default"
print("" if k == "default" else k.replace(",", "x"))
PY
  }
  l15=$(best 15); l60=$(best 60); echo "best launches: 15 rows '$l15', 60 rows '$l60'"
  h4=HF2Q_DRAFT_HEAD_BITS=4
  v4="HF2Q_DRAFT_HEAD_BITS=0,HF2Q_DRAFT_HEAD_BITS=8,$h4,$h4+HF2Q_DRAFT_HEAD_MM_ROWS=64"
  [ -n "$l60" ] && v4="$v4+HF2Q_QMM_LAUNCH=$l60"
  ab_run ab_head4 200 --synthetic 4b --slots 4 --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 2 --values "$v4"
  v1="HF2Q_DRAFT_HEAD_BITS=0,HF2Q_DRAFT_HEAD_BITS=8,$h4"
  [ -n "$l15" ] && v1="$v1,$h4+HF2Q_QMM_LAUNCH=$l15"
  t=$(left)
  [ "$t" -gt 50 ] && ab_run ab_head1 $(( t < 100 ? t : 100 )) --synthetic 4b --modes plain,dflash \
    --tokens 32 --prompt-tokens 64 --runs 2 --values "$v1"
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_gpu "$t" tests/test_kernels_qmatmul.py \
    tests/test_kernels_gated_delta.py tests/test_runtime_fidelity.py \
    tests/test_runtime_draft_head.py -k "cuda or greedy or tokens"
  ;;
3)
  # the 4-bit head's launches again, four slots' 60 rows first (run 1 on a slow host reached
  # only 15 rows in 90 s: first compiles), the K-split's wider blocks and the column split
  timeout $(( $(left) - 10 )) python3 benchmarks/quant_rows.py --shapes head --bits 4 --rows 60,15 \
    --ops 2 --reps 9 --tune "8,4,1;16,4,1;8,8,1;4,4,1;2,8,1,8;1,8,1,8;2,4,1,8;4,4,1,4;4,8,1,8" \
    --out "$OUT/qtune.json" > "$OUT/qtune.log" 2>&1
  echo "qtune exit $? $(el)"; cut -c1-400 "$OUT/qtune.log"
  ;;
esac
host_speed
pack_logs
