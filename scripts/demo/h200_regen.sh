#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): regenerate training data for the demo drafter with
# the shipped demo target, several processes at once (regeneration is bound by the host: mlx-lm's
# batched decode of a 9 M-parameter model leaves the GPU mostly idle, and the machine has 16 cores).
#
# Each process is a one-step `hf2q train-draft` run whose OUT/checkpoint/dataset.npz is the data
# set (scripts/demo/regen_set.sh); process i takes seed i and its own prompt length (PROMPTS, one per
# process), so no two processes regenerate the same sequence: a 256-token chunk cut at 64 tokens
# and at 48 tokens gives two different continuations. MAX_SEQS chunks each (of the ~31.5 k
# 256-token chunks of the training files).
#
# Inputs: $TEXT/train.jsonl.xz and $TEXT/heldout.jsonl (runs/demo/text of prepare_data.py);
# outputs: $STASH/prep-<i>/checkpoint/dataset.npz on the machine (for the training call while it
# stays warm) and an xz copy of each in $OUT (regen-<i>.npz.xz), with the logs.
set -uo pipefail
: "${OUT:?set OUT}"
TEXT=${TEXT:-.device/s3}
STASH=${STASH:-/root/hf2q-stash}
PROMPTS=${PROMPTS:-64 48 96 32}
MAX_SEQS=${MAX_SEQS:-16384}
LIMIT=${LIMIT:-420}
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0
t0=$(date +%s)
W=$(mktemp -d)
xz -dkc "$TEXT/train.jsonl.xz" > "$W/train.jsonl"
i=0
for p in $PROMPTS; do
  timeout "$LIMIT" bash scripts/demo/regen_set.sh hf2q/demo/target "$W/train.jsonl" \
    "$TEXT/heldout.jsonl" "$STASH/prep-$i" "$i" "$p" "$MAX_SEQS" > "$OUT/regen-$i.log" 2>&1 &
  i=$((i + 1))
done
wait
echo "[$(( $(date +%s) - t0 ))s] regenerated"
for d in "$STASH"/prep-*; do
  n=${d##*-}
  f=$d/checkpoint/dataset.npz
  if [ -f "$f" ]; then
    xz -T4 -3 -c "$f" > "$OUT/regen-$n.npz.xz"
    echo "prep-$n: $(du -h "$f" | cut -f1) -> $(du -h "$OUT/regen-$n.npz.xz" | cut -f1)"
  else
    echo "prep-$n: no data set"; tail -c 600 "$OUT/regen-$n.log"
  fi
done
grep -h "regenerate \|sequences" "$OUT"/regen-*.log | grep -v "/" | head -n 12
echo "[$(( $(date +%s) - t0 ))s] done"
(cd "$OUT" && tar czf regen_logs.tar.gz ./regen-*.log && rm -f ./regen-*.log)
