# Sourced by the H200 call scripts: checks OUT, puts the install and the tree on PYTHONPATH,
# starts the clock (S) and defines el, the seconds since the start as "[Ns]".
: "${OUT:?set OUT}"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S=$(date +%s)
el() { echo "[$(( $(date +%s) - S ))s]"; }
