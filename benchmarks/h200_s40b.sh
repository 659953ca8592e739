#!/usr/bin/env bash
# Session 40, second H200 call: a single sequence's verify forward as one compiled graph
# (HF2Q_COMPILE_VERIFY, hf2q.kernels.forward.CompiledVerify). (1) the synchronous single-sequence
# round (HF2Q_LAGGED_ROUNDS=0: the loop `hf2q generate --dflash` runs with lookup drafts) with the
# graph off and on, alternating in one process, at 1024 positions; (2) the GPU tests of the
# graph's bits (bf16 exact: verify rows against decode steps through it), the compiled step,
# fidelity, slot isolation, quantized targets, four pytest workers sharing the GPU; (3) the demo
# pair with lookup, off / on; (4) verify_cost's runtime paths (layer path, graph), call by call.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
(export HF2Q_LAGGED_ROUNDS=0
 ab_run ab_verify1024 130 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 1024 \
   --runs 5 --env HF2Q_COMPILE_VERIFY --values 0,1)
gpu_pytest pytest_s40 220 -n 4 tests/test_runtime_bf16_exact.py tests/test_kernels_verify_graph.py \
  tests/test_kernels_forward.py tests/test_runtime_fidelity.py tests/test_slots_isolation.py \
  tests/test_kernels_qmatmul.py
t=$(left)
[ "$t" -gt 60 ] && ab_run ab_demo_lookup $(( t < 100 ? t : 100 )) --demo --lookup --modes plain,dflash \
  --tokens 128 --runs 3 --env HF2Q_COMPILE_VERIFY --values 0,1
t=$(left)
[ "$t" -gt 40 ] && timeout "$t" python3 benchmarks/verify_cost.py --dtypes bf16 \
  --paths runtime,runtime-whole --reps 9 --no-profile --out "$OUT/verify_cost.json" \
  > "$OUT/verify_cost.log" 2>&1
echo "verify_cost exit $? $(el)"; grep -A3 "^path " "$OUT/verify_cost.log" | cut -c1-200
host_speed
pack_logs
