#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): the demo pair with bucket-padded attention keys.
# 1. step_trace.py: plain vs DFlash step/round times in one process (first run = JIT warm-up).
# 2. hf2q bench --slots 1,2,4,8 on the demo pair (batched DFlash vs plain batched).
# 3. The CUDA-only kernel tests not yet run on the H200, in the time left.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0
S=$(date +%s)
left() { echo $(( ${BUDGET:-440} - ($(date +%s) - S) )); }
timeout 120 python3 benchmarks/step_trace.py --tokens 256 --repeats 2 --out "$OUT/trace_bucket.json" \
  > "$OUT/trace_bucket.log" 2>&1
echo "trace exit $? [$(( $(date +%s) - S ))s]"
cut -c1-330 "$OUT/trace_bucket.log"
timeout "${BENCH_S:-240}" python3 -m hf2q bench --slots 1,2,4,8 --gen-tokens 128 --trials 3 --warmup 1 \
  --json --out "$OUT/slots-demo.json" > "$OUT/slots-demo.log" 2>&1
echo "bench exit $? [$(( $(date +%s) - S ))s]"
python3 - "$OUT/slots-demo.json" <<'PY' || tail -c 600 "$OUT/slots-demo.log"
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["results"]:
    print(x["slots"], x["mode"], x["tokens_per_s"], "round", x["round_ms"], "split",
          x["draft_ms"], x["verify_ms"], x["rollback_ms"], "tau", x["tau"], "E", x["E"],
          "xplain", x["speedup_vs_plain"], "=", x["matches_plain"])
PY
t=$(left)
[ "$t" -gt 20 ] && timeout "$t" python3 -m pytest -q -x tests/test_kernels_attention.py \
  tests/test_kernels_layers.py > "$OUT/cuda_tests.log" 2>&1
echo "tests exit $? [$(( $(date +%s) - S ))s]"
tail -n 3 "$OUT/cuda_tests.log"
