#!/usr/bin/env bash
# Session 32, third GPU call (what the session's device time had left): (1) where the 4B-shaped
# pair's host time goes now, one sequence, by evaluation site (graph_nodes.py --time: node counts
# and the host ms of each eval / async_eval), DFlash rounds against plain steps; (2) the CUDA-only
# kernel and runtime tests (skipped on a CPU), as a regression check of the code as it is.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 200 python3 benchmarks/graph_nodes.py --synthetic 4b --prompt-tokens 64 --slots 0 \
  --modes dflash,plain --gen-tokens 32 --top 20 --time --out "$OUT/nodes4b.json" > "$OUT/nodes4b.log" 2>&1
echo "nodes4b exit $? $(el)"; grep -v '^\s*$' "$OUT/nodes4b.log" | tail -n 40 | cut -c1-220
t=$(left)
[ "$t" -gt 40 ] && gpu_pytest gpu_cuda "$t" tests/test_kernels_matmul.py tests/test_kernels_rollback.py \
  tests/test_kernels_row_attention.py tests/test_kernels_forward.py tests/test_kernels_gated_delta.py \
  tests/test_runtime_prefill_runners.py tests/test_runtime_sdpa_bucket.py
host_speed
pack_logs
