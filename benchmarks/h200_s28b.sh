#!/usr/bin/env bash
# Session 28, third call: where the demo pair's 8-slot DFlash round goes (issue 5's 8-slot goal:
# 1.18-1.22x plain batched in sessions 27-28, 1.50x in session 24). The demo target is small, so its
# rounds are launches and host work: (1) kernel traces of DFlash rounds and plain steps at 1 and
# 8 slots (device busy against wall); (2) graph nodes a round and the time each evaluation takes
# to encode / wait, at 1 and 8 slots; (3) cProfile of the host thread at 8 slots.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
timeout 150 python3 benchmarks/gpu_timeline.py --slots 1,8 --loops slots-dflash,slots-plain --lookup \
  --tokens 64 --top 30 --out "$OUT/tl_demo.json" > "$OUT/tl_demo.log" 2>&1
echo "tl_demo exit $? $(el)"; grep -A34 '^==' "$OUT/tl_demo.log" | cut -c1-150
for s in 1 8; do
  t=$(left); [ "$t" -lt 60 ] && break
  timeout 90 python3 benchmarks/graph_nodes.py --slots "$s" --modes dflash,plain --gen-tokens 64 \
    --top 14 --time --out "$OUT/nodes_demo$s.json" > "$OUT/nodes_demo$s.log" 2>&1
  echo "nodes_demo$s exit $? $(el)"; grep -v '^{' "$OUT/nodes_demo$s.log" | cut -c1-200 | head -40
done
t=$(left)
if [ "$t" -gt 60 ]; then
  timeout 80 python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain --slots 8 --lookup \
    --tokens 64 --top 30 --out "$OUT/host_demo8.json" > "$OUT/host_demo8.log" 2>&1
  echo "host_demo8 exit $? $(el)"; cut -c1-160 "$OUT/host_demo8.log" | grep -v "^\s*$" | head -66
fi
pack_logs
