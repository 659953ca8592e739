#!/usr/bin/env bash
# Session 49's device calls (after the three keep.sh calls and install.sh).
# PART=1, after the fused Gated-DeltaNet kernel's state went to 16-byte loads and stores (run 1's
# probe: 17.5 -> 11.9 us a one-slot decode layer, 34.3 -> 30.9 a verify layer): its CUDA tests
# (with the state 4 bytes off alignment); drafts from an 8- or 4-bit copy of the head end to end
# (plain_ab.py alternating HF2Q_DRAFT_HEAD_BITS 0 / 8 / 4 at one and four slots) and per product
# at a draft's 15 rows (one slot) and 60 (four): MLX's quantized product and hf2q's dequantizing
# kernel (quant_rows.py), against the bf16 head's kernel and cuBLAS (node_cost.py); then the
# random 4B-shaped pair at 1, 4, 8 slots in what is left.
# PART=2 (BUDGET=450): the draft head's A/Bs again after the changes run 2 asked for (see
# there), then the Gated-DeltaNet CUDA tests with the time left.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
case "${PART:-1}" in
1)
  gpu_pytest pytest_gdn 90 tests/test_kernels_gated_delta.py -k cuda
  # drafts from an 8- or 4-bit copy of the head (--draft-head-bits), alternating in one process
  heads=HF2Q_DRAFT_HEAD_BITS=0,HF2Q_DRAFT_HEAD_BITS=8,HF2Q_DRAFT_HEAD_BITS=4
  ab_run ab_head1 100 --synthetic 4b --modes plain,dflash --tokens 32 --prompt-tokens 64 \
    --runs 3 --values "$heads"
  ab_run ab_head4 100 --synthetic 4b --slots 4 --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 3 --values "$heads"
  t=$(left)
  [ "$t" -gt 40 ] && timeout $(( t < 80 ? t : 80 )) python3 benchmarks/quant_rows.py --shapes head \
    --bits 8,4 --rows 1,15,60 --kernel --ops 2 --reps 5 --out "$OUT/qhead.json" \
    > "$OUT/qhead.log" 2>&1
  echo "qhead exit $? $(el)"; tail -n 12 "$OUT/qhead.log" | cut -c1-300
  t=$(left)
  [ "$t" -gt 30 ] && timeout $(( t < 50 ? t : 50 )) python3 benchmarks/node_cost.py --rows 1,15,60 \
    --shapes head4b --ops 2 --reps 5 --out "$OUT/bfhead.json" > "$OUT/bfhead.log" 2>&1
  echo "bfhead exit $? $(el)"; grep -v '"add"' "$OUT/bfhead.log" | cut -c1-200 | tail -n 8
  t=$(left)
  [ "$t" -gt 60 ] && synthetic_run syn4b 1,4,8 "$t"
  ;;
2)
  # after run 2: 8-bit copies through MLX's product at every row count, and a draft's quantized
  # head off the kernel as one product of all slots' rows (was: a GEMM a slot)
  heads=HF2Q_DRAFT_HEAD_BITS=0,HF2Q_DRAFT_HEAD_BITS=8,HF2Q_DRAFT_HEAD_BITS=4
  ab_run ab_head4 90 --synthetic 4b --slots 4 --modes plain,dflash --tokens 32 \
    --prompt-tokens 64 --runs 2 --values "$heads"
  t=$(left)
  [ "$t" -gt 50 ] && ab_run ab_head1 $(( t < 90 ? t : 90 )) --synthetic 4b --modes plain,dflash \
    --tokens 32 --prompt-tokens 64 --runs 2 --values "$heads"
  # run 2 cut these at 12 passed by a 90 s timeout (first compiles on a fresh machine)
  t=$(left)
  [ "$t" -gt 60 ] && gpu_pytest pytest_gdn "$t" tests/test_kernels_gated_delta.py -k cuda
  ;;
esac
host_speed
pack_logs
