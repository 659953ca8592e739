#!/usr/bin/env bash
# For the next H200 calls (after the three keep.sh calls and install.sh). Sessions 41-43 were lent
# no GPU, so this carries h200_s42.sh's runs, after the K-split across thread blocks
# (HF2Q_MM_KSPLIT, opt-in until measured): the 4-slot verify's 64-row products of 2560 columns
# launch 80 thread blocks on 132 SMs (40 at 2 slots); split, 160 and a reduction (same bits).
# PART=1: its CUDA bit tests, the device time of the default launch against 2, 4 and 8 blocks a
# column block (kernel_trace.py --ksplit-only, the 4B target's down and output projections at
# 16-128 rows), the 4-slot rounds alternating KSPLIT 0 / 4 (2 blocks there) in one process; then
# the draft graph's CUDA tests and its A/B after 1024 positions (h200_s42.sh PART=1).
# PART=2: h200_s42.sh PART=2 (the 4- and 1-slot round traces, the draft graph at 4 slots, issue
# 5's random-pair runs at 1, 4, 8 slots, the final-state record); PART=3: h200_s42.sh PART=3.
# In parts 2 and 3 DRAFT=0/1 and KSPLIT=0/2/4/8 set HF2Q_COMPILE_DRAFT and HF2Q_MM_KSPLIT for every
# run that does not set them itself (what part 1 settles).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
case "${PART:-1}" in
1)
  host_speed
  gpu_pytest pytest_ksplit 90 -k "k_split" tests/test_kernels_matmul.py
  timeout 150 python3 benchmarks/kernel_trace.py --products 9216x2560,4096x2560 \
    --rows 16,32,48,64,128 --ksplit-only --reps 20 --out "$OUT/ksplit_trace.json" \
    > "$OUT/ksplit_trace.log" 2>&1
  echo "ksplit_trace exit $? $(el)"
  grep -o '"job": "[^"]*".*"us_median": [0-9.]*' "$OUT/ksplit_trace.log"
  ab_run ab_ksplit_s4 130 --synthetic 4b --slots 4 --modes dflash --tokens 32 --prompt-tokens 64 \
    --runs 3 --env HF2Q_MM_KSPLIT --values 0,4
  t=$(left)
  [ "$t" -gt 80 ] && gpu_pytest pytest_draft_graph $(( t < 110 ? t : 110 )) -n 2 -k draft \
    tests/test_draft_graph.py tests/test_kernels_row_attention.py
  t=$(left)
  [ "$t" -gt 60 ] && ab_run ab_draft1024 "$t" --synthetic 4b --modes plain,dflash --tokens 48 \
    --prompt-tokens 1024 --runs 3 --env HF2Q_COMPILE_DRAFT --values 0,1
  host_speed
  pack_logs
  ;;
*)
  export HF2Q_MM_KSPLIT=${KSPLIT:-0}
  bash benchmarks/h200_s42.sh
  ;;
esac
