#!/usr/bin/env bash
# H200 call 4 of session 20 (after .device/s2/install.sh): the product kernel's tests on the GPU in
# full (call 3 stopped at the dispatch test's stale count, before the CUDA tests ran).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_matmul.py \
  > "$OUT/cuda_tests.log" 2>&1
echo "kernel tests exit $? $(el)"; grep -E "passed|failed|FAILED|SKIPPED" "$OUT/cuda_tests.log" | tail -n 8
