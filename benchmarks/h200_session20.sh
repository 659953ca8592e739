#!/usr/bin/env bash
# Next H200 call (after .device/s2/install.sh): what session 19 could not finish on its slow last
# host. The layer shapes' launch at 8 m-tiles (four column blocks won for the head's width: does it
# for 2560-9216 columns too?), grouped products off/on alternating on the demo pair at 8 slots
# (the plain step got faster with them; does DFlash's round?), and issue 5's runs with the
# defaults (the demo pair with a queue, the 4B-shaped pair at 1/4/8 slots).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
node_tune node_tune128 128 4b 120
ab_run ab_grouped_demo8 200 --demo --lookup --slots 8 --tokens 128 --runs 4 \
  --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain,dflash
demo_queue_bench demo-rps4
synthetic_variants synthetic-final HF2Q_DRAFT_MM_ROWS "32"
pack_logs
