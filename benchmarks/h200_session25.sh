#!/usr/bin/env bash
# Session 25's first H200 call (after the three stage calls): what session 24 left unmeasured
# (benchmarks/h200_next.sh: the CUDA rollback/replay tests its last call cut, the demo pair's
# bench on the final tree) and where the device time of the final tree's 4-slot round goes
# (gpu_timeline.py under the profiler: session 24 traced only the old tree), then the 4B-shaped
# pair at 1, 2, 3, 4 slots in what remains.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest t_cuda 150 tests/test_kernels_rollback.py tests/test_kernels_gated_delta.py -m "not slow" \
  -k "final_state or conv_kernel or stats or (replay and cuda)"  # (emulated variants: slow)
for s in 4 1; do
  t=$(left); [ "$t" -lt 200 ] && break
  timeout 80 python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --slots "$s" \
    --tokens 32 --top 40 --sequence 2500 --loops slots-dflash --out "$OUT/tl_s$s.json" \
    > "$OUT/tl_s$s.log" 2>&1
  echo "tl_s$s exit $? $(el)"; grep -A45 '^==' "$OUT/tl_s$s.log" | cut -c1-150
done
demo_queue_bench demo-rps4
synthetic_run synthetic 1,2,3,4 "$(left)"
pack_logs
