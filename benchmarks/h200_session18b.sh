#!/usr/bin/env bash
# H200 call (after .device/s2/install.sh): where the host's time goes in the batched DFlash
# round with lookup (the CLI's default) at 8 slots, against plain batched decoding and the
# single-sequence loop (demo pair); then hf2q bench with continuous batching (4 requests queued
# per slot) and the random 4B-shaped pair at 1, 4, 8 slots (issue 5's goals, current defaults).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
timeout 120 python3 benchmarks/host_profile.py --loops slots-dflash,slots-plain,dflash --slots 8 \
  --tokens 128 --lookup --top 45 --out "$OUT/host8.json" > "$OUT/host8.log" 2>&1
echo "host profile exit $? $(el)"; grep '^==' "$OUT/host8.log"
timeout 170 python3 -m hf2q bench --slots 1,4,8 --requests-per-slot 4 --gen-tokens 128 \
  --trials 3 --warmup 1 --json --out "$OUT/demo-rps4.json" > "$OUT/demo-rps4.log" 2>&1
echo "demo rps4 exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/demo-rps4.json" || tail -c 400 "$OUT/demo-rps4.log"
t=$(( ${BUDGET:-540} - ($(date +%s) - S) - 5 ))
timeout "$t" python3 benchmarks/slots_synthetic.py --shape 4b --slots 1,4,8 --gen-tokens 32 \
  --prompt-tokens 64 --trials 3 --warmup 1 --out "$OUT/synthetic.json" > "$OUT/synthetic.log" 2>&1
echo "synthetic exit $? $(el)"
python3 benchmarks/bench_rows.py "$OUT/synthetic.json" || tail -c 600 "$OUT/synthetic.log"
