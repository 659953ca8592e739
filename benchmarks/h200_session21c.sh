#!/usr/bin/env bash
# H200 call 3 of session 21 (after .device/s2/install.sh): call 1's launch tune again with the
# kinds taking turns within each rep (call 1 timed each launch's reps back to back, in order, and
# the default, timed first, was often faster than the same launch timed later as a candidate).
# Ten launch shapes at 32-128 rows of the 4B shapes, row blocks among them, 15 reps.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
C="4,8,4;8,8,4;8,8,1;4,8,1;8,8,2,2;8,8,4,2;4,8,4,2;8,8,1,2;4,8,2,2;8,8,1,1;4,8,1,4;8,8,2,4"
for rows in 64,48 128,32; do
  t=$(left); [ "$t" -lt 60 ] && break
  timeout "$t" python3 benchmarks/node_cost.py --rows "$rows" --shapes 4b --ops 16 --reps 15 --tune \
    --cands "$C" --out "$OUT/tune_${rows/,/_}.json" > "$OUT/tune_${rows/,/_}.log" 2>&1
  echo "tune $rows exit $? $(el)"
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("tune_*.json")):
    res = [r for r in json.loads(f.read_text())["results"] if r["kind"] != "add"]
    for rows in sorted({r["rows"] for r in res}):
        ks = {}
        for r in res:
            if r["rows"] == rows:
                ks.setdefault(r["kind"], {})[(r["K"], r["N"])] = r["total_us"]
        for k, v in sorted(ks.items(), key=lambda kv: sum(kv[1].values()))[:6]:
            print(rows, k, [v.get(s) for s in ((2560, 9216), (9216, 2560), (2560, 2560))], round(sum(v.values()), 1))
PY
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
