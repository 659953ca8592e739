#!/usr/bin/env bash
# H200 call 7 of session 20 (after .device/s2/install.sh): the product kernel's launch shapes that
# keep the bits at 32 and 48 rows (2 and 3 slots of a 16-token verify) on the 4B shapes.
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
node_tune node_tune_32_48 32,48 4b 100
