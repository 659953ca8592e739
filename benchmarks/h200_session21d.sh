#!/usr/bin/env bash
# H200 call 4 of session 21 (after .device/s2/install.sh): eight column blocks unrolled 4 times at
# two m-tiles (call 3's fairer tune): the kernel's CUDA tests (a row's bits at 1-96 rows), the
# 4B-shaped pair at 1, 2, 3, 4 and 8 slots, the demo pair with a queue (issue 5's runs), then the
# bf16 DFlash-equals-plain tests.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_matmul.py -k cuda \
  > "$OUT/cuda_tests.log" 2>&1
echo "kernel tests exit $? $(el)"; grep -E "passed|failed|FAILED|Error" "$OUT/cuda_tests.log" | tail -n 8
timeout 200 python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,2,3,4,8 --gen-tokens 32 \
  --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/synthetic.json" > "$OUT/synthetic.log" 2>&1
echo "synthetic exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/synthetic.json" || tail -c 300 "$OUT/synthetic.log"
demo_queue_bench demo-rps4
t=$(left)
if [ "$t" -gt 40 ]; then
  timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/test_runtime_bf16_exact.py > "$OUT/bf16_exact.log" 2>&1
  echo "bf16 exact exit $? $(el)"; tail -n 2 "$OUT/bf16_exact.log"
fi
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
