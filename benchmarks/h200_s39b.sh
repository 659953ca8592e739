#!/usr/bin/env bash
# Session 39, second call: the attention kernel's blocks compute HB of a KV head's query heads
# (HF2Q_ATTN_HEADS; no bit depends on it) and its chunk merge runs one thread an output element.
# Run 1: a plain step's attention 19.9 us a layer (20 blocks of 8 warps), a verify's 51.8 and the
# drafter's 64.7 (one block an SM: registers). (1) kernel traces of plain steps and DFlash rounds
# at 1024 positions with HB = 1 and 2 (4, the whole group, was run 1); (2) the attention and bf16
# GPU tests; (3) plain and DFlash decoding at 1024 (plain_ab.py).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
for hb in 1 2; do
  for loop in plain dflash; do
    t=$(left); [ "$t" -lt 300 ] && break
    HF2Q_ATTN_HEADS=$hb timeout 80 python3 benchmarks/gpu_timeline.py --synthetic 4b \
      --prompt-tokens 1024 --loops $loop --slots 1 --tokens 48 --top 25 \
      --out "$OUT/tl_${loop}1024_hb$hb.json" > "$OUT/tl_${loop}1024_hb$hb.log" 2>&1
    echo "tl_${loop}1024_hb$hb exit $? $(el)"
    grep -A30 '^==' "$OUT/tl_${loop}1024_hb$hb.log" | grep -E "^==|attention|gaps" | cut -c1-150
  done
done
ab_run ab1024 90 --synthetic 4b --modes plain,dflash --tokens 64 --prompt-tokens 1024 --runs 5
t=$(left)
[ "$t" -gt 60 ] && gpu_pytest pytest_attn "$t" tests/test_kernels_row_attention.py \
  tests/test_runtime_bf16_exact.py
host_speed
pack_logs
