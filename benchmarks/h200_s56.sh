#!/usr/bin/env bash
# The next lease's first call (after the three keep.sh calls and install.sh), with BUDGET=540.
# Session 56's tune (an H100) timed the MLP's gate and up at 64 rows with the column split of 2 or
# 4 warps at 35.7-36.1 us against 39.6-41.2 for the K-split, the 16-row time. Session 26's wider
# column split had also won alone and lost inside the verify's graph, so this call first alternates
# HF2Q_MM_SPLIT64 (off, 4x4, 2x4) in one process at 4 slots, where the verify and the drafter run
# 64 rows, with 32768 draft ids: the DFlash round's median per value, and its tokens against the
# first value's (plain_ab.py's same_tokens). Then the goals' slot sweep at today's defaults (on
# an H200, the goals' figures; on a fast host, comparable with session 55's), and the demo pair's
# queue (issue 5's 8-slot goal).
set -uo pipefail
# shellcheck source=benchmarks/h200_common.sh
. benchmarks/h200_common.sh
host_speed
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
V=HF2Q_DRAFT_VOCAB=32768
ab_slots split64_ "4" "$V+HF2Q_MM_SPLIT64=0,$V+HF2Q_MM_SPLIT64=4x4,$V+HF2Q_MM_SPLIT64=2x4"
synthetic_run syn4b_v32k 1,4,8 150 --draft-vocab 32768
demo_queue_bench demo_queue
host_speed
pack_logs
