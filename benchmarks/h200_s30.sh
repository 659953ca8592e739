#!/usr/bin/env bash
# Session 30, first call: where the demo pair's 8-slot round goes (issue 5: DFlash at 8 slots
# 1.18-1.50x plain batched decoding in sessions 24-29, goal 1.5x; the round is the host's).
# (1) a cProfile of the host thread, DFlash rounds and plain steps at 8 slots with lookup drafts
# (hf2q bench's default), 128 tokens; (2) a kernel trace of the same loops; (3) graph nodes a round
# by call site and primitive on CUDA (no lookup: graph_nodes.py runs the loop's default).
# A fresh machine first spends 80-110 s compiling MLX's kernels: the first process has 240 s.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 240 python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain --slots 8 --lookup \
  --tokens 128 --top 45 --out "$OUT/host_demo8.json" > "$OUT/host_demo8.log" 2>&1
echo "host_demo8 exit $? $(el)"; cut -c1-170 "$OUT/host_demo8.log" | grep -v "^\s*$" | head -70
t=$(left)
[ "$t" -gt 40 ] && timeout "$t" python3 benchmarks/gpu_timeline.py --slots 8 --loops slots-dflash,slots-plain \
  --lookup --tokens 128 --top 40 --out "$OUT/tl_demo8.json" > "$OUT/tl_demo8.log" 2>&1
echo "tl_demo8 exit $? $(el)"; grep -A45 '^==' "$OUT/tl_demo8.log" | cut -c1-150
t=$(left)
[ "$t" -gt 40 ] && timeout "$t" python3 benchmarks/graph_nodes.py --slots 8 --gen-tokens 64 --top 30 \
  --out "$OUT/nodes_demo8.json" > "$OUT/nodes_demo8.log" 2>&1
echo "nodes_demo8 exit $? $(el)"; grep -v '^{' "$OUT/nodes_demo8.log" | cut -c1-400
pack_logs
