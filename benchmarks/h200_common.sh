# Sourced by the H200 call scripts: checks OUT, puts the install and the tree on PYTHONPATH,
# starts the clock (S) and defines el, the seconds since the start as "[Ns]".
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S=$(date +%s)
el() { echo "[$(( $(date +%s) - S ))s]"; }
# left: the seconds of ${BUDGET:-560} still free, less 5 for what follows a run.
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - S) - 5 )); }

# The graph-node cuts' settings, as plain_ab.py --values spells them (NAME=V joined by +): V the
# draft vocabulary the goals' sweeps use, NR the q/k norm + RoPE launch, NM the layers' norms in
# their products' launches, ALL session 59's three opt-in cuts (the gated norm is the default),
# SW the SwiGLU launch at one m-tile.
V=HF2Q_DRAFT_VOCAB=32768
NR=HF2Q_NORM_ROPE=1
NM=HF2Q_NORM_MM=1
ALL=HF2Q_ATTN_GATE=1+HF2Q_NORM_ROPE=1+HF2Q_ACCEPT_KERNEL=1
SW=HF2Q_MM_SWIGLU=1+HF2Q_MM_SWIGLU_ROWS=16

# host_speed: how fast this machine's host runs Python (a loop of 1e7 adds; 0.7-1.4 s on the
# H200 machines lent so far), printed first: host-bound rounds follow it.
host_speed() {
  python3 -c "
import time; t = time.perf_counter(); s = 0
for i in range(10**7): s += i
print('host: python loop of 1e7 adds %.2f s' % (time.perf_counter() - t))"
}

# node_costs NAME ROWS: benchmarks/node_cost.py on the 4B shapes at ROWS (comma-separated) into
# $OUT/NAME.json / .log, its product rows shown.
node_costs() {
  timeout 100 python3 benchmarks/node_cost.py --rows "$2" --shapes 4b --ops 16 --reps 5 \
    --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "node_cost exit $? $(el)"
  grep -v '"add"' "$OUT/$1.log" | cut -c1-150
}

# node_tune NAME ROWS SHAPES TIMEOUT: benchmarks/node_cost.py --tune (the launch shapes that keep
# the bits) at ROWS of SHAPES into $OUT/NAME.json / .log, each product's kind and time shown.
node_tune() {
  timeout "$4" python3 benchmarks/node_cost.py --rows "$2" --shapes "$3" --ops 16 --reps 5 --tune \
    --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "node_cost tune $3 exit $? $(el)"
  grep -v '"add"' "$OUT/$1.log" | grep -o '"N": [0-9]*, "rows": [0-9]*, "kind": "[^"]*".*"total_us": [0-9.]*'
}

# synthetic_run NAME SLOTS TIMEOUT [ARGS...]: the random 4B-shaped pair at SLOTS (comma-separated;
# 32 new tokens after 64 prompt tokens, 3 trials after a warm-up; ARGS more of slots_synthetic.py's
# options) into $OUT/NAME.json / .log, its rows shown.
synthetic_run() {
  timeout "$3" python3 benchmarks/slots_synthetic.py --shape 4b --slots "$2" --gen-tokens 32 \
    --prompt-tokens 64 --trials 3 --warmup 1 "${@:4}" --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/$1.json" || tail -c 300 "$OUT/$1.log"
}

# synthetic_variants NAME VAR "VALUES": synthetic_run at 1, 4, 8 slots once per value of VAR (one
# process each), while ${BUDGET:-560} s allow, into $OUT/NAME<value>.json / .log.
synthetic_variants() {
  local v t
  for v in $3; do
    t=$(left)
    [ "$t" -lt 40 ] && break
    (export "$2=$v"; synthetic_run "$1$v" 1,4,8 "$t")
  done
}

# ab_run NAME TIMEOUT ARGS...: benchmarks/plain_ab.py ARGS into $OUT/NAME.json / .log, its report's
# start shown.
# sweep_pairs SETTINGS: the goals' sweep (1 and 4 slots, 32768 draft ids), the defaults and
# SETTINGS (env assignments separated by spaces) one process each, alternated twice, a pair at a
# time or not at all.
sweep_pairs() {
  local r g t settings
  for r in a b; do
    [ "$(left)" -lt 170 ] && break
    for g in default cuts; do
      t=$(( $(left) / 2 )); [ "$g" = cuts ] && t=$(left)
      [ "$t" -gt 105 ] && t=105
      settings=""; [ "$g" = cuts ] && settings="$1"
      (for kv in $settings; do export "${kv?}"; done
       synthetic_run "syn4b_${g}_$r" 1,4 "$t" --draft-vocab 32768)
    done
  done
}
ab_run() {
  local name=$1 t=$2
  shift 2
  timeout "$t" python3 benchmarks/plain_ab.py "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el)"; tail -n 1 "$OUT/$name.log" | cut -c1-1200
}

# ab_slots PREFIX "SLOTS" VALUES [MIN]: ab_run PREFIX<slots> for the random 4B-shaped pair's DFlash
# rounds (32 new tokens after 64, 3 runs) at each slot count of SLOTS (space-separated), the
# settings VALUES alternating in one process, while at least MIN (60) of ${BUDGET:-560} s remain.
ab_slots() {
  local s t
  for s in $2; do
    t=$(left); [ "$t" -lt "${4:-60}" ] && break
    ab_run "$1$s" "$t" --synthetic 4b --slots "$s" --modes dflash --tokens 32 \
      --prompt-tokens 64 --runs 3 --values "$3"
  done
}

# demo_queue_bench NAME [SLOTS]: hf2q bench on the demo pair at SLOTS (1,4,8) with 4 requests per slot, in
# what remains of ${BUDGET:-560} s, into $OUT/NAME.json / .log, its rows shown.
demo_queue_bench() {
  local t
  t=$(left)
  [ "$t" -lt 100 ] && return
  timeout "$t" python3 -m hf2q bench --slots "${2:-1,4,8}" --requests-per-slot 4 --gen-tokens 128 \
    --trials 3 --warmup 1 --json --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? $(el)"; python3 benchmarks/bench_rows.py "$OUT/$1.json" || tail -c 400 "$OUT/$1.log"
}

# issue_runs: issue 5's and 6's runs: demo_queue_bench demo_queue, then the random 4B-shaped pair
# at 1 and 4 slots (synthetic_run syn4b) in what remains of ${BUDGET:-560} s.
issue_runs() {
  local t
  demo_queue_bench demo_queue
  t=$(left)
  [ "$t" -gt 60 ] && synthetic_run syn4b 1,4 "$t"
}

# demo_timeline NAME LINES: gpu_timeline.py on the demo pair's 8-slot rounds with lookup (128
# tokens, DFlash and plain loops) in at most 110 s of what remains, into $OUT/NAME.json / .log,
# LINES lines of each summary shown.
demo_timeline() {
  local t
  t=$(left)
  [ "$t" -gt 60 ] && timeout $(( t < 110 ? t : 110 )) python3 benchmarks/gpu_timeline.py --slots 8 \
    --loops slots-dflash,slots-plain --lookup --tokens 128 --top 40 --out "$OUT/$1.json" \
    > "$OUT/$1.log" 2>&1
  echo "$1 exit $? $(el)"; grep -A"$2" '^==' "$OUT/$1.log" | cut -c1-150
}

# bench_values NAME SLOTS VALUES: benchmarks/bench_ab.py (hf2q bench's workload, the settings
# VALUES alternating in one process, 3 runs) at SLOTS (comma-separated), at most 240 s, into
# $OUT/NAME.json / .log, its rows shown.
bench_values() {
  timeout 240 python3 benchmarks/bench_ab.py --slots "$2" --runs 3 --values "$3" \
    --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? $(el)"; grep '^{"slots' "$OUT/$1.log" | cut -c1-400
}

# gpu_pytest NAME TIMEOUT ARGS...: pytest ARGS into $OUT/NAME.log in one process (the GPU is one
# device: pyproject's `-n auto` workers would share it, and the device's install may lack
# pytest-xdist), its summary shown. Verbose, so that a run cut by TIMEOUT still says which tests
# passed (session 24 runs 2 and 5 only had dots), and each failure's report as it fails
# (HF2Q_TEST_INSTAFAIL, tests/conftest.py; session 50 lost one to the limit).
gpu_pytest() {
  local name=$1 t=$2
  shift 2
  HF2Q_TEST_INSTAFAIL=1 timeout "$t" python3 -m pytest -v -o addopts=-ra -p no:cacheprovider "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name exit $? $(el): $(grep -c ' PASSED' "$OUT/$name.log") passed"
  grep -E " FAILED| ERROR|[0-9]+ (passed|failed)" "$OUT/$name.log" | tail -n 8
}

# tune_turns PREFIX "CANDS" ROWS...: benchmarks/node_cost.py --tune --cands CANDS (the launches
# timed in turn, 15 reps; chained nodes with CHAIN=1) on the 4B shapes (or $SHAPES) for each
# comma-separated ROWS in what remains of ${BUDGET:-560} s, into $OUT/PREFIX_<rows>.json / .log;
# then each row count's six fastest kinds.
tune_turns() {
  local prefix=$1 cands=$2 rows t
  shift 2
  for rows in "$@"; do
    t=$(left); [ "$t" -lt 60 ] && break
    timeout "$t" python3 benchmarks/node_cost.py --rows "$rows" --shapes "${SHAPES:-4b}" --ops 16 --reps 15 \
      --tune ${CHAIN:+--chain} --cands "$cands" --out "$OUT/${prefix}_${rows//,/_}.json" \
      > "$OUT/${prefix}_${rows//,/_}.log" 2>&1
    echo "tune $rows exit $? $(el)"
  done
  python3 - "$OUT" "$prefix" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob(f"{sys.argv[2]}_*.json")):
    res = [r for r in json.loads(f.read_text())["results"] if r["kind"] != "add"]
    for rows in sorted({r["rows"] for r in res}):
        ks = {}
        for r in res:
            if r["rows"] == rows:
                ks.setdefault(r["kind"], {})[(r["K"], r["N"])] = r["total_us"]
        for k, v in sorted(ks.items(), key=lambda kv: sum(kv[1].values()))[:6]:
            print(rows, k, [v[s] for s in sorted(v, reverse=True)], round(sum(v.values()), 1))
PY
}

# timelines "SLOTS" [MIN] [LIMIT]: gpu_timeline.py on the random 4B-shaped pair's DFlash rounds (32
# new tokens after 64, the first 2500 kernels kept in order) at each slot count of SLOTS
# (space-separated), one process each (LIMIT s, 80 unless given; unbuffered, so a process cut off
# at its limit still shows how far it got), while at least MIN (250) of ${BUDGET:-560} s remain,
# into $OUT/tl_s<slots>.json / .log, each summary shown; $TL_ARGS: more gpu_timeline.py options.
timelines() {
  local s t
  for s in $1; do
    t=$(left); [ "$t" -lt "${2:-250}" ] && break
    PYTHONUNBUFFERED=1 timeout "${3:-80}" python3 benchmarks/gpu_timeline.py --synthetic 4b \
      --prompt-tokens 64 --slots "$s" --tokens 32 --top 40 --sequence 2500 --loops slots-dflash ${TL_ARGS:-} --out "$OUT/tl_s$s.json" \
      > "$OUT/tl_s$s.log" 2>&1
    echo "tl_s$s exit $? $(el)"; grep -A70 '^==' "$OUT/tl_s$s.log" | cut -c1-150
  done
}

# pack_logs: the call's logs into $OUT/logs.tar.gz (one file travels back where many might not).
pack_logs() {
  (cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
}
