#!/usr/bin/env bash
# Issue 6 on the GPU in one command: kernel smoke (compile + check + microbench), the kernel
# correctness tests with CUDA enabled, and benchmarks/verify_cost.py at the Qwen3.5-4B shapes.
#
# Run from the repository root on the device machine after MLX CUDA is installed in /tmp/site:
#   bash benchmarks/gpu_kernels.sh
# Writes 6 files to $OUT (default runs/gpu): env.txt, smoke.json, smoke.log, pytest.log,
# verify_cost.json, verify_cost.log. Each part has its own time limit (90 + 120 + 100 + 260 s at
# most) and a failing part does not stop the next; exit status is that of verify_cost.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.draw --format=csv 2>&1
  python3 -c "import sys, mlx.core as mx, mlx_lm; print('python', sys.version.split()[0]); print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, 'cuda', mx.cuda.is_available()); print(mx.device_info())" 2>&1
  git log -1 --oneline 2>&1 || true
} > "$OUT/env.txt"
cat "$OUT/env.txt"

stamp "1/3 kernel smoke: every variant compiled, checked against ops, timed"
timeout 90 python3 benchmarks/gpu_smoke.py --out "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1
echo "smoke exit status $?" >> "$OUT/smoke.log"
grep -E "FAILED|error|Error|variants:|us/call|exit status" "$OUT/smoke.log" | tail -40

stamp "2/3 pytest (CUDA tests enabled, emulator tests deselected)"
timeout 120 python3 -m pytest tests/test_kernels_gated_delta.py tests/test_kernels_gdn_layer.py \
  tests/test_kernels_attention.py tests/test_kernels_layers.py -q -rs -m "not slow" \
  -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "kernel tests exit status $?" >> "$OUT/pytest.log"
if [ -f tests/test_runtime_fidelity.py ]; then
  # Greedy fidelity of DFlash (token-equal to plain decoding, float32) with the kernels enabled.
  echo "== tests/test_runtime_fidelity.py on the GPU" >> "$OUT/pytest.log"
  timeout 100 python3 -m pytest tests/test_runtime_fidelity.py -q -rs -p no:cacheprovider \
    >> "$OUT/pytest.log" 2>&1
  echo "fidelity tests exit status $?" >> "$OUT/pytest.log"
fi
grep -E "passed|failed|error|exit status" "$OUT/pytest.log" | tail -12

stamp "3/3 verify_cost (4B shapes, bf16 then 4-bit)"
timeout 260 python3 benchmarks/verify_cost.py --budget-s 200 ${VERIFY_COST_ARGS:-} --out "$OUT/verify_cost.json" \
  > "$OUT/verify_cost.log" 2>&1
rc=$?
echo "verify_cost exit status $rc" >> "$OUT/verify_cost.log"
grep -v "profile T=" "$OUT/verify_cost.log" | tail -45
stamp "done"
exit $rc
