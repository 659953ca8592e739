#!/usr/bin/env bash
# For the next H200 call (after the three stage calls; not yet run). Session 23 found both pairs'
# 1-slot rounds bound by the host's building and encoding of the verify (cProfile: 4.2 ms of a
# 9.7 ms round of the 4B-shaped pair), so this call measures what that work is made of, with the
# session's defaults (lagged rounds with the draft queued first and the verify every 8 layers;
# the final-state record from 128 MiB a layer): graph nodes by call site and primitive with each
# evaluation's encoding time (graph_nodes.py --time) at one and four slots, then the kernel trace
# of a 1-slot and a 4-slot round (where the device still waits), then the 4B-shaped pair at
# 1, 2, 3, 4 slots (the 3-slot step with the new record default).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
for s in 1 4; do
  t=$(left); [ "$t" -lt 60 ] && break
  # The verify's queued parts (HF2Q_FLUSH_LAYERS) are evaluated inside TargetModel.forward,
  # which graph_nodes.py does not count: off here, so the acceptance's evaluation holds them all.
  HF2Q_FLUSH_LAYERS=0 timeout 100 python3 benchmarks/graph_nodes.py --synthetic 4b --prompt-tokens 64 --slots "$s" \
    --modes dflash,plain --gen-tokens 32 --top 20 --time --out "$OUT/nodes_s$s.json" \
    > "$OUT/nodes_s$s.log" 2>&1
  echo "nodes_s$s exit $? $(el)"; head -c 2500 "$OUT/nodes_s$s.log"
done
for s in 1 4; do
  t=$(left); [ "$t" -lt 60 ] && break
  timeout 90 python3 benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --slots "$s" \
    --tokens 32 --top 30 --sequence 2500 --loops slots-dflash --out "$OUT/tl_s$s.json" \
    > "$OUT/tl_s$s.log" 2>&1
  echo "tl_s$s exit $? $(el)"; grep -A20 '^==' "$OUT/tl_s$s.log" | cut -c1-150
done
synthetic_run synthetic 1,2,3,4 "$(left)"
pack_logs
