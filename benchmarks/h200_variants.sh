#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): hf2q bench's random Qwen3.5-4B-shaped pair
# (benchmarks/slots_synthetic.py, no lookup drafts, so every round runs the drafter) once per
# environment variant, back to back in one process each, then CUDA tests in the time left.
#   VARIANTS  space-separated; each a comma-separated list of VAR=value ("-" = defaults), e.g.
#             VARIANTS="HF2Q_FLUSH_LAYERS=0 - HF2Q_FLUSH_LAYERS=4 HF2Q_FUSE_PROJ=1"
#   SLOTS     slot counts (default 1,4); SHAPE 4b (default) or small (a CPU check of this script)
#   TESTS     pytest paths for the time left (default none); BUDGET seconds for the whole call
# Writes $OUT/synthetic-<n>.json / .log per variant and $OUT/cuda_tests.log.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S=$(date +%s)
n=0
for v in ${VARIANTS:--}; do
  n=$((n + 1))
  envs=()
  [ "$v" != - ] && IFS=, read -r -a envs <<< "$v"
  f="$OUT/synthetic-$n"
  env "${envs[@]}" timeout "${VARIANT_S:-200}" python3 benchmarks/slots_synthetic.py \
    --shape "${SHAPE:-4b}" --slots "${SLOTS:-1,4}" --gen-tokens 32 --prompt-tokens 64 --trials 3 \
    --warmup 1 --out "$f.json" > "$f.log" 2>&1
  echo "variant $n [$v] exit $? [$(( $(date +%s) - S ))s]"
  python3 benchmarks/bench_rows.py "$f.json" || tail -c 600 "$f.log"
done
t=$(( ${BUDGET:-540} - ($(date +%s) - S) ))
# shellcheck disable=SC2086  # TESTS is a list of paths
if [ "${TESTS:-none}" != none ] && [ "$t" -gt 20 ]; then
  timeout "$t" python3 -m pytest -q -x $TESTS > "$OUT/cuda_tests.log" 2>&1
  echo "tests exit $? [$(( $(date +%s) - S ))s]"
  tail -n 3 "$OUT/cuda_tests.log"
fi
