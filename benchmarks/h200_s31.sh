#!/usr/bin/env bash
# Written in session 30 for the next GPU call (not run yet).
# (1) HF2Q_DRAFT_AHEAD (off by default): synchronous batched greedy rounds queue the next round's
# drafter before reading their acceptance, so the device drafts while the host reads, commits
# and picks proposals. hf2q bench's workload (demo pair, built-in prompts, 4 requests a slot, 128
# tokens, lookup) with the switch 0 / 1 alternating in one process, at 8 and 1 slots. Session
# 30: an 8-slot round is 2.8 ms longer than a 1-slot one while a plain step is 0.37 ms longer;
# the device's 1.75 ms of an 8-slot round sit unoverlapped in synchronous rounds.
# (2) How the host's part of the round splits between building graphs, encoding kernels and
# waiting, by evaluation site (graph_nodes.py --lookup --time: eval = encoding + waiting,
# async_eval = encoding only), at 8 slots, the switch off and on.
# A fresh machine first spends 80-110 s compiling MLX's kernels: the first process has 240 s.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
bench_values ab_ahead 8,1 HF2Q_DRAFT_AHEAD=0,HF2Q_DRAFT_AHEAD=1
nodes() {  # NAME SLOTS [env assignments]: graph_nodes.py --lookup --time into $OUT/NAME.*
  local name=$1 slots=$2 t
  shift 2
  t=$(left); [ "$t" -lt 60 ] && return
  env "$@" timeout $(( t < 120 ? t : 120 )) python3 benchmarks/graph_nodes.py --slots "$slots" \
    --lookup --time --gen-tokens 128 --top 20 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; grep -v '^{' "$OUT/$name.log" | cut -c1-220
}
nodes nodes8 8
nodes nodes8_ahead 8 HF2Q_DRAFT_AHEAD=1
pack_logs
