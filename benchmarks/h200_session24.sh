#!/usr/bin/env bash
# Session 24's call (after the three stage calls). The changes it measures take graph nodes out
# of multi-slot rounds (the host encodes each node; session 24 run 1 counted 1431 a 4-slot round
# of the 4B-shaped pair against 826 at one slot): final-state rollbacks copy every layer's conv
# rows in one launch, slot caches build their position arithmetic once for all layers, and the
# drafter's products on cuBLAS read kept transposed weights. First the GPU tests of the changed
# paths, then the old tree (BASE, the commit before the changes, carried in .device/base) against
# the new one at 1 and 4 slots, alternating processes on one machine, then the demo pair's bench
# and the 4-slot graph nodes of the new tree.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
BASE=${BASE:-.device/base}
gpu_pytest tests_changed 150 tests/test_kernels_rollback.py tests/test_runtime_bf16_exact.py \
  tests/test_kernels_matmul.py tests/test_slots_isolation.py \
  -k "rollback or exact or frozen or cuda_drafts or bf16 or lagged"
for rep in 1 2; do
  for tree in "$BASE" .; do
    t=$(left); [ "$t" -lt 150 ] && break 2
    name=ab_$( [ "$tree" = . ] && echo new || echo base )_$rep
    timeout 80 python3 "$tree/benchmarks/slots_synthetic.py" --shape 4b --slots 1,4 --gen-tokens 32 \
      --prompt-tokens 64 --trials 3 --warmup 1 --no-baseline --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "$name exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/$name.json" || tail -c 300 "$OUT/$name.log"
  done
done
demo_queue_bench demo-rps4
t=$(left)
if [ "$t" -gt 60 ]; then
  HF2Q_FLUSH_LAYERS=0 timeout 60 python3 benchmarks/graph_nodes.py --synthetic 4b --prompt-tokens 64 --slots 4 \
    --modes dflash --gen-tokens 32 --top 20 --time --out "$OUT/nodes_s4.json" > "$OUT/nodes_s4.log" 2>&1
  echo "nodes_s4 exit $? $(el)"; head -c 2000 "$OUT/nodes_s4.log"
fi
pack_logs
