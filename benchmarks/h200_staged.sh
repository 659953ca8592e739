#!/usr/bin/env bash
# For the next H200 call (after .device/s2/install.sh; not yet run on a GPU): weights staged
# through shared memory with cp.async (cuda_matmul's tune, fourth value: chunks in flight), the
# candidate for the 64-row products that bind issue 5's 4-slot round (37.7 us for 2560 x 9216
# against a 9.8 us weight-read floor, session 21 run 3). First the kernel's CUDA tests (staged
# launches bit-equal to the default at 16, 64 and 128 rows), then the launches timed in turn.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest cuda_tests 120 tests/test_kernels_matmul.py -k cuda
C="4,8,4;4,8,1;4,8,1,2;4,8,1,3;4,8,1,4;4,8,2,2;4,8,2,3;4,8,2,4;8,8,1,2;8,8,4,2"
for rows in 64,48 128,32,16; do
  t=$(left); [ "$t" -lt 60 ] && break
  timeout "$t" python3 benchmarks/node_cost.py --rows "$rows" --shapes 4b --ops 16 --reps 15 --tune \
    --cands "$C" --out "$OUT/staged_${rows//,/_}.json" > "$OUT/staged_${rows//,/_}.log" 2>&1
  echo "tune $rows exit $? $(el)"
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("staged_*.json")):
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
