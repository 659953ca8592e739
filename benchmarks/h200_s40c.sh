#!/usr/bin/env bash
# Session 40, third H200 call: the verify as one compiled graph for slot caches too (lagged and
# synchronous batched rounds; HF2Q_COMPILE_VERIFY, on by default on CUDA). (1) the GPU tests of
# its bits: bf16 verify rows against decode steps through the graph, the graph against the layer
# path, greedy DFlash and batched rounds through it; (2) the one-slot lagged round (the loop
# plain_ab's DFlash and `hf2q generate --dflash --no-lookup` run on CUDA), graph off / on,
# alternating in one process, at 1024 positions; (3) issue 5's runs at the new defaults: the
# bf16 4B-shaped pair at 1, 4, 8 slots and the demo pair through hf2q bench at 1 and 8 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
gpu_pytest pytest_graph 130 -n 2 tests/test_runtime_bf16_exact.py tests/test_kernels_verify_graph.py
ab_run ab_lagged1024 130 --synthetic 4b --modes plain,dflash --tokens 48 --prompt-tokens 1024 \
  --runs 3 --env HF2Q_COMPILE_VERIFY --values 0,1
t=$(left)
[ "$t" -gt 100 ] && synthetic_run syn4b_bf16 1,4,8 $(( t < 120 ? t : 120 ))
t=$(left)
[ "$t" -gt 60 ] && timeout "$t" python3 -m hf2q bench --slots 1,8 --requests-per-slot 4 \
  --gen-tokens 128 --trials 2 --warmup 1 --json --out "$OUT/demo_queue.json" > "$OUT/demo_queue.log" 2>&1
echo "demo_queue exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/demo_queue.json" || tail -c 300 "$OUT/demo_queue.log"
host_speed
pack_logs
