#!/usr/bin/env bash
# Usage: bash benchmarks/device_base.sh COMMIT
# Puts the tree of COMMIT (hf2q/ and the synthetic benchmark) in .device/base, without files over
# 500 kB (the demo pair's weights), for an H200 call that times an old tree against the working
# one on the same machine: carry ".device/base" beside ".device/s2" and run
# `python3 .device/base/benchmarks/slots_synthetic.py ...` (the script puts its own root first on
# sys.path, so it imports that tree's hf2q). Session 24's runs 2 and 5 did this by hand.
set -euo pipefail
commit=${1:?usage: bash benchmarks/device_base.sh COMMIT}
rm -rf .device/base
mkdir -p .device/base
git archive "$commit" hf2q benchmarks/slots_synthetic.py benchmarks/shapes.py | tar -x -C .device/base
find .device/base -type f -size +500k -delete
echo ".device/base: $(git rev-parse --short "$commit"), $(du -sh .device/base | cut -f1)"
