#!/usr/bin/env bash
# Session 62's second call, on the machine h200_s61.sh left warm: does a shorter block help
# issue 5's 8-slot goal? At 8 slots a verify is 8 x 16 rows, where the products cost more than at
# one or four slots (sessions 55-57), and on a CPU a shorter block won 1.49x (--block-size auto,
# docs/BENCHMARKS.md "Block sizes on a CPU"); the batched runtime keeps one size for all slots.
# hf2q bench on the demo pair's queue (8 slots, 4 requests a slot, 128 tokens, 3 trials after a
# warm-up; DFlash, plain batched decoding and one-sequence runs as the bench measures them) at
# block 16, then 8, then 16, then 8, one process each, while the budget lasts.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
for run in a b; do
  for b in 16 8; do
    t=$(left); [ "$t" -lt 70 ] && break 2
    timeout "$t" python3 -m hf2q bench --slots 8 --requests-per-slot 4 --gen-tokens 128 \
      --trials 3 --warmup 1 -b "$b" --json --out "$OUT/q8_b${b}_$run.json" \
      > "$OUT/q8_b${b}_$run.log" 2>&1
    echo "q8_b${b}_$run exit $? $(el)"
    python3 benchmarks/bench_rows.py "$OUT/q8_b${b}_$run.json" || tail -c 400 "$OUT/q8_b${b}_$run.log"
  done
done
host_speed
