#!/usr/bin/env bash
# Session 29, first call: is the demo pair's 8-slot DFlash round (issue 5: 1.18-1.22x plain batched
# in sessions 27-28, goal 1.5x) held back by its rounds being synchronous? With lookup drafts (the
# default) a round waits for the last one's acceptance whenever a row's lookup proposal is due,
# which at 8 rows is nearly always; without lookup the rounds are lagged (the host builds round
# k+1 while the device computes round k) but tau drops. (1) hf2q bench at 8 slots: lookup (sync),
# no lookup (lagged), no lookup with HF2Q_LAGGED_ROUNDS=0 (sync): the round times say what lagging
# buys at equal rows. (2) benchmarks/h200_s28b.sh's traces, graph nodes and host profile.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
b8() {  # NAME ARGS...: hf2q bench at 8 slots (4 requests per slot, 128 tokens, 3 trials)
  local name=$1
  shift
  timeout 100 python3 -m hf2q bench --slots 8 --requests-per-slot 4 --gen-tokens 128 --trials 3 \
    --warmup 1 --json --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/$name.json" || tail -c 400 "$OUT/$name.log"
}
b8 b8_lookup
b8 b8_nolookup_lagged --no-lookup --no-baseline
HF2Q_LAGGED_ROUNDS=0 b8 b8_nolookup_sync --no-lookup --no-baseline
HF2Q_LAGGED_LOOKUP=1 b8 b8_lookup_lagged --no-baseline
pack_logs
mv "$OUT/logs.tar.gz" "$OUT/logs_bench.tar.gz"
BUDGET=$(left) bash benchmarks/h200_s28b.sh
