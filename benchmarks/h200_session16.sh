#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh) for session 16's HF2Q_GROUPED_MM (products sharing
# an input in one launch of the small-M kernel, residual adds in the product's launch):
# 1. the CUDA tests of the kernels (bits equal to the separate launches and MLX's add);
# 2. benchmarks/plain_ab.py --synthetic 4b: plain ms/token, DFlash round and E with the switch
#    0 / 1, alternating in one process (tokens compared: plain == DFlash, 0 == 1);
# 3. benchmarks/slots_synthetic.py --shape 4b --slots 1,4 with the switch on (issue 5's ratio);
# 4. greedy DFlash == plain in bf16 on the GPU with the switch on (tests/test_runtime_bf16_exact.py);
# 5. hf2q bench on the demo pair, switch on, in the time left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 120 python3 -m pytest -q tests/test_kernels_matmul.py -k cuda > "$OUT/tests_matmul.log" 2>&1
echo "matmul tests exit $? $(el)"; tail -n 4 "$OUT/tests_matmul.log"
timeout 200 python3 benchmarks/plain_ab.py --synthetic 4b --tokens "${AB_TOKENS:-64}" --runs "${AB_RUNS:-4}" \
  --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain,dflash --out "$OUT/ab_grouped.json" \
  > "$OUT/ab_grouped.log" 2>&1
echo "plain_ab exit $? $(el)"; tail -n 1 "$OUT/ab_grouped.log" | cut -c1-900
HF2Q_GROUPED_MM=1 timeout 150 python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4 \
  --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/slots4b.json" > "$OUT/slots4b.log" 2>&1
echo "slots_synthetic exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/slots4b.json" || tail -c 600 "$OUT/slots4b.log"
HF2Q_GROUPED_MM=1 timeout 150 python3 -m pytest -q -x tests/test_runtime_bf16_exact.py \
  > "$OUT/tests_bf16.log" 2>&1
echo "bf16 tests exit $? $(el)"; tail -n 3 "$OUT/tests_bf16.log"
t=$(( ${BUDGET:-540} - ($(date +%s) - S) ))
if [ "$t" -gt 40 ]; then
  HF2Q_GROUPED_MM=1 timeout "$t" python3 -m hf2q bench --slots 1,8 --gen-tokens 128 --trials 3 \
    --warmup 1 --json --out "$OUT/bench_demo.json" > "$OUT/bench_demo.log" 2>&1
  echo "bench exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/bench_demo.json" || tail -c 400 "$OUT/bench_demo.log"
fi
