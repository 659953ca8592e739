#!/usr/bin/env bash
# One H200 call after scripts/demo/h200_regen.sh on the same machine: train the demo drafter (3
# layers, as shipped) on the data sets it regenerated, then race the new drafter against the
# shipped one with `hf2q bench` (the demo target, a queue of requests, 1 and 8 slots), the two
# drafters alternating. The drafter comes back in $OUT/draft (z-lab format, with train_log.json).
#
# STASH: where h200_regen.sh left prep-*/checkpoint/dataset.npz (else $OUT of that call, carried
# as .device/s4/regen-*.npz.xz). STEPS / TOTAL_MINUTES: the schedule's length and the cut.
set -uo pipefail
: "${OUT:?set OUT}"
STASH=${STASH:-/root/hf2q-stash}
STEPS=${STEPS:-10000}
TOTAL_MINUTES=${TOTAL_MINUTES:-4.0}
BUDGET=${BUDGET:-560}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
sets=$(ls "$STASH"/prep-*/checkpoint/dataset.npz 2>/dev/null)
if [ -z "$sets" ]; then  # a fresh machine: the carried copies
  mkdir -p "$STASH/carried"
  for f in .device/s4/regen-*.npz.xz; do
    xz -dkc "$f" > "$STASH/carried/$(basename "$f" .xz)"
  done
  sets=$(ls "$STASH"/carried/*.npz)
fi
echo "data sets: $sets"
D=$(mktemp -d)
ln -s "$PWD/hf2q/demo/target" "$D/target"
cp .device/s3/heldout.jsonl "$D/"
MLX_ENABLE_TF32=1 RUN="$STASH/draft-run3" DATA=$D PREPARED="$sets" LAYERS=3 STEPS=$STEPS \
  TOTAL_MINUTES=$TOTAL_MINUTES EVAL_PROMPTS=0 OUT=$OUT bash scripts/demo/train_draft_gpu.sh
since "trained"
[ -f "$OUT/draft/config.json" ] || exit 1
export MLX_ENABLE_TF32=0
bench() {  # name, draft folder
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ "$left" -gt 60 ] || { since "no time for bench $1"; return; }
  timeout $((left - 10)) python3 -m hf2q bench -m hf2q/demo/target -d "$2" --slots 1,8 \
    --requests-per-slot 4 --gen-tokens 128 --trials 2 --warmup 1 --json --out "$OUT/bench_$1.json" \
    > "$OUT/bench_$1.log" 2>&1
  since "bench $1 exit $?"
  python3 benchmarks/bench_rows.py "$OUT/bench_$1.json" 2>/dev/null | head -n 12
}
bench new1 "$OUT/draft"
bench shipped1 hf2q/demo/draft
bench new2 "$OUT/draft"
bench shipped2 hf2q/demo/draft
(cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
