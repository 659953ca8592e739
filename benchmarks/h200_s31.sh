#!/usr/bin/env bash
# Written in session 30 for the next GPU call (not run yet): how the host's part of the demo
# pair's DFlash round splits between building graphs, encoding kernels and waiting for the
# device, by evaluation site (benchmarks/graph_nodes.py --time: eval = encoding + waiting,
# async_eval = encoding only; the rest of a round is Python and graph building), for the
# synchronous lookup rounds hf2q bench runs (--lookup) at 8 and 1 slots, and for lagged rounds
# with proposals on the device (HF2Q_LAGGED_LOOKUP=device) at 8 slots. Session 30: an 8-slot
# round is 2.8 ms longer than a 1-slot one while a plain step is 0.37 ms longer, and the device's
# 1.75 ms of an 8-slot round are not overlapped with the host's work in synchronous rounds.
# A fresh machine first spends 80-110 s compiling MLX's kernels: the first process has 240 s.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nodes() {  # NAME SLOTS TIMEOUT [env assignments]: graph_nodes.py --lookup --time into $OUT/NAME.*
  local name=$1 slots=$2 t=$3
  shift 3
  env "$@" timeout "$t" python3 benchmarks/graph_nodes.py --slots "$slots" --lookup --time \
    --gen-tokens 128 --top 20 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; grep -v '^{' "$OUT/$name.log" | cut -c1-220
}
nodes nodes8 8 240
t=$(left); [ "$t" -gt 60 ] && nodes nodes1 1 $(( t < 120 ? t : 120 ))
t=$(left); [ "$t" -gt 60 ] && nodes nodes8_device 8 $(( t < 120 ? t : 120 )) HF2Q_LAGGED_LOOKUP=device
pack_logs
