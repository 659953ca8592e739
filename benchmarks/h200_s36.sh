#!/usr/bin/env bash
# Session 36, one call: the issues' headline runs at the final commit. The random 4B-shaped pair in
# bf16 at 1, 4 and 8 slots, the same pair with a 4-bit target and a 4-bit drafter (the dequantizing
# kernel) at 1, 4 and 8 slots, then the demo pair through hf2q bench at 1, 4 and 8 slots with a
# queue; the host's speed before and after.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
synthetic_run syn4b_bf16 1,4,8 150
t=$(left)
[ "$t" -gt 60 ] && timeout $(( t < 150 ? t : 150 )) python3 benchmarks/slots_synthetic.py --shape 4b \
  --slots 1,4,8 --gen-tokens 32 --prompt-tokens 64 --trials 3 --warmup 1 --target-bits 4 \
  --draft-bits 4 --out "$OUT/syn4b_t4d4.json" > "$OUT/syn4b_t4d4.log" 2>&1
echo "syn4b_t4d4 exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/syn4b_t4d4.json" || tail -c 300 "$OUT/syn4b_t4d4.log"
demo_queue_bench demo_queue
host_speed
pack_logs
