#!/usr/bin/env bash
# Session 50's device calls (after the three keep.sh calls and install.sh), as runs 1 and 2 ran
# them: PART=2 (BUDGET=560): the 4-bit draft head's kernel launches timed in turn (quant_rows.py
# --tune: wider column blocks, and the column split that 7c3ced1 dropped after this: its
# four-value launches now time nothing), then session 49's pending A/Bs of the draft head at four
# and one slots with the fastest launch as a value, then the GPU tests with the time left. The
# goals' runs planned here went to benchmarks/h200_s51.sh.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
case "${PART:-2}" in
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
esac
host_speed
pack_logs
