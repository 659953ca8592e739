#!/usr/bin/env bash
# For the next H200 call (after the three stage calls; not yet run). What session 24 left
# unmeasured: the GPU tests its last call cut (the rollback file's final-state tests and the
# gated-delta replay tests on CUDA, with the kept conv weight and the joined replay), the demo
# pair's bench on the tree with every node cut (run 5 ran out of time), and the demo pair's 8-slot
# graph and host profile (both cut at 60 s in run 4: the demo's first process compiles MLX's
# kernels; given 150 s here), then the 4B-shaped pair at 1, 2, 3, 4 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
gpu_pytest t_cuda 150 tests/test_kernels_rollback.py tests/test_kernels_gated_delta.py -m "not slow" \
  -k "final_state or conv_kernel or stats or (replay and cuda)"  # (emulated variants: slow)
demo_queue_bench demo-rps4
t=$(left)
if [ "$t" -gt 160 ]; then
  timeout 150 python3 benchmarks/graph_nodes.py --slots 8 --modes dflash,plain --gen-tokens 64 --top 30 \
    --time --out "$OUT/nodes_demo8.json" > "$OUT/nodes_demo8.log" 2>&1
  echo "nodes_demo8 exit $? $(el)"; head -c 2500 "$OUT/nodes_demo8.log"
fi
t=$(left)
if [ "$t" -gt 100 ]; then
  timeout 90 python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain --slots 8 --lookup \
    --tokens 128 --top 45 --out "$OUT/host_demo8.json" > "$OUT/host_demo8.log" 2>&1
  echo "host_demo8 exit $? $(el)"; head -c 2500 "$OUT/host_demo8.log"
fi
synthetic_run synthetic 1,2,3,4 "$(left)"
pack_logs
