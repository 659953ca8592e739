#!/usr/bin/env bash
# Session 24's last call (after the stage calls), with the kept conv weight (commit 42dce89) and
# the replay's joined conv read (4ace161) on top of the node cuts of h200_session24.sh: the GPU
# tests of the changed kernel paths (greedy bf16 DFlash equal to plain decoding, the per-row
# replay, the conv rollback launch), the old tree (.device/base, commit 9f9feb0) against the new
# at 1 and 4 slots (the new one with its plain and sequential rows: E in the same process), then
# the demo pair's bench.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
BASE=${BASE:-.device/base}
gpu_pytest t_exact 130 tests/test_runtime_bf16_exact.py tests/test_kernels_gated_delta.py \
  tests/test_kernels_rollback.py -k "exact or replay or final_state or conv_kernel"
for tree in "$BASE" .; do
  t=$(left); [ "$t" -lt 120 ] && break
  if [ "$tree" = . ]; then name=ab_new; extra=(); else name=ab_base; extra=(--no-baseline); fi
  timeout 80 python3 "$tree/benchmarks/slots_synthetic.py" --shape 4b --slots 1,4 --gen-tokens 32 \
    --prompt-tokens 64 --trials 3 --warmup 1 "${extra[@]}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/$name.json" || tail -c 300 "$OUT/$name.log"
done
demo_queue_bench demo-rps4
pack_logs
