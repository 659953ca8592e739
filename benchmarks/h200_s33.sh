#!/usr/bin/env bash
# Session 33, last GPU call: issue 5's demo-pair record with the drafter shipped this session
# (commit 2f90124): hf2q bench at 1, 4 and 8 slots with a queue, the host's speed before and after.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout "$(left)" python3 -m hf2q bench --slots 1,4,8 --requests-per-slot 4 --gen-tokens 128 \
  --trials 3 --warmup 1 --json --out "$OUT/bench_demo_new.json" > "$OUT/bench_demo_new.log" 2>&1
echo "bench exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/bench_demo_new.json"
host_speed
pack_logs
