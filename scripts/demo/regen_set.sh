#!/usr/bin/env bash
# One regenerated data set for the demo drafter: a one-step `hf2q train-draft --regenerate` run
# whose OUT/checkpoint/dataset.npz later runs take as --data (the recipe's fixed flags live here).
#
#   bash scripts/demo/regen_set.sh TARGET TRAIN_JSONL HELDOUT_JSONL OUT SEED PROMPT_TOKENS MAX_SEQS
#
# Used by make_demo.sh (step 3) and h200_regen.sh. PY: the Python to run (default python3);
# REGEN_BATCH: prompts regenerated together (default 64, what MLX 0.32's CUDA backend takes).
set -euo pipefail
[ $# -eq 7 ] || { echo "usage: $0 TARGET TRAIN_JSONL HELDOUT_JSONL OUT SEED PROMPT_TOKENS MAX_SEQS" >&2; exit 2; }
exec "${PY:-python3}" -m hf2q train-draft -t "$1" -o "$4" --force \
  --data "$2" --eval-data "$3" --eval-prompts 0 \
  --layers 3 --target-layer-ids 1,3,5 --block-size 16 --seq-len 256 --batch-size 8 \
  --seed "$5" --max-seqs "$7" --regenerate --regen-prompt-tokens "$6" \
  --regen-batch "${REGEN_BATCH:-64}" --feature-cache-gb 0 --steps 1
