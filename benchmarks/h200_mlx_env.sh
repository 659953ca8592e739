#!/usr/bin/env bash
# One H200 call (after .device/s2/install.sh): does how MLX's CUDA backend submits work change the
# demo pair's plain steps and DFlash rounds? step_trace.py (plain + DFlash, 3 runs, the last is the
# steady state) under each setting of MLX's own knobs: the default (CUDA graphs of at most 100
# kernels on an H200), MLX_USE_CUDA_GRAPHS=0 (kernels launched on the stream one by one), and
# MLX_MAX_OPS_PER_BUFFER=20 / 400 (smaller / larger graphs); $TRACES picks the settings (default
# "default nographs ops20 ops400"; also "fuseproj": HF2Q_FUSE_PROJ=1, "nosmallmm": HF2Q_SMALL_MM=0, "norows": HF2Q_ROW_ATTENTION=0). Then, when $BENCH is set,
# the 8-slot bench with a queue (--requests-per-slot 4) under those settings (e.g. "default fuseproj").
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MLX_ENABLE_TF32=0
S=$(date +%s)
run_env() {  # name, then env assignments
  local name=$1; shift
  env "$@" timeout 100 python3 benchmarks/step_trace.py --modes plain,dflash --tokens 256 --repeats 3 \
    --out "$OUT/trace_$name.json" > "$OUT/trace_$name.log" 2>&1
  echo "== $name ($*) exit $? [$(( $(date +%s) - S ))s]"
  python3 - "$OUT/trace_$name.json" <<'PY' || tail -c 400 "$OUT/trace_$name.log"
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r["run"] > 1:
        print(r["mode"], r["run"], "tok/s", r["tok_s"], "median ms", r["median_ms"], "tau", r.get("tau"))
PY
}
setting() {  # name -> the env assignment it stands for
  case $1 in nographs) echo MLX_USE_CUDA_GRAPHS=0 ;; ops20) echo MLX_MAX_OPS_PER_BUFFER=20 ;;
    ops400) echo MLX_MAX_OPS_PER_BUFFER=400 ;; fuseproj) echo HF2Q_FUSE_PROJ=1 ;;
    nosmallmm) echo HF2Q_SMALL_MM=0 ;; norows) echo HF2Q_ROW_ATTENTION=0 ;;
    *) echo MLX_DUMMY=1 ;; esac
}
for name in ${TRACES:-default nographs ops20 ops400}; do
  run_env "$name" "$(setting "$name")"
done
for name in ${BENCH:-}; do
  e=$(setting "$name")
  env $e timeout 150 python3 -m hf2q bench --slots 8 --requests-per-slot 4 --gen-tokens 128 --trials 2 \
    --warmup 1 --json --out "$OUT/bench8_rps4_$name.json" > "$OUT/bench8_rps4_$name.log" 2>&1
  echo "== bench $name exit $? [$(( $(date +%s) - S ))s]"
  python3 - "$OUT/bench8_rps4_$name.json" <<'PY' || tail -c 400 "$OUT/bench8_rps4_$name.log"
import json, sys
for x in json.load(open(sys.argv[1]))["results"]:
    print(x["slots"], x["mode"], x["tokens_per_s"], "round", x["round_ms"], "busy", x["busy_rows"],
          "tau", x["tau"], "E", x["E"], "xplain", x["speedup_vs_plain"])
PY
done
