#!/usr/bin/env bash
# Session 37, one call: h200_s36b.sh for the 4-bit 4B-shaped target alone (session 36's call ran
# out of its budget after the 4-bit decode-1): verify_cost.py with 260 s (timeout 320 s) into
# verify_cost_4bit.json, then the 4-bit pair's decode loops after a 1024-token prompt into
# ab4_ctx1024.json.
DTYPES=4bit VC_BUDGET=260 TARGET_BITS=4 NAME=4bit exec bash benchmarks/h200_s36b.sh
