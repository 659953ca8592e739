"""What a kernel pays to read a small array the host made or read: MLX's CUDA backend keeps
such arrays in managed (unified) memory, so a GPU kernel reading one may first fault its page
over from the host.

Why: the demo pair's 8-slot DFlash round traces (docs/BENCHMARKS.md, session 30) show small
kernels with medians of 30-50 us (a gather of a block's token ids, copies of a few ids, the
lookup proposals' select, the rollback kernel's counts) where the same kernels elsewhere take
2-4 us; each round builds such inputs on the host (``mx.array(list)``) and reads its results
back (``tolist``). This times one small gather evaluated alone, its index array made in four
ways, alternating, and reports medians of the wall time of ``mx.eval``:

- ``device``: computed on the device from a device array (no host page in sight);
- ``host``: ``mx.array(list)`` made on the host for every call (what a round does for its block,
  its lookup proposals, its counts);
- ``host-read``: computed on the device, then read by the host (``tolist``), then gathered with
  (what happens to a round's acceptance and bonus tokens when the next round reuses them);
- ``host-scalar``: a 2-element host array (8 bytes: MLX's scalar pool, mapped for the GPU).

Usage:
    python benchmarks/fault_cost.py --reps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

MODES = ("device", "host", "host-read", "host-scalar")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--size", type=int, default=64, help="ids in the index array")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    table = mx.zeros((1 << 16, 256), dtype=mx.bfloat16)
    base = mx.arange(args.size, dtype=mx.int32)
    mx.eval(table, base)

    def index(mode: str, i: int) -> mx.array:
        if mode == "device":
            return base + (i % 7)
        if mode == "host":
            return mx.array([(j + i) % 1000 for j in range(args.size)], dtype=mx.int32)
        if mode == "host-read":
            idx = base + (i % 7)
            mx.eval(idx)
            idx.tolist()
            return idx
        return mx.array([i % 1000, (i + 1) % 1000], dtype=mx.int32)

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.reps + 20):
        for m in MODES:
            idx = index(m, i)
            if m == "device":
                mx.eval(idx)  # its own evaluation, untimed: the timed one only reads it
            y = mx.take(table, idx, axis=0).sum()
            tic = time.perf_counter()
            mx.eval(y)
            dt = time.perf_counter() - tic
            if i >= 20:
                times[m].append(dt)
    res = {
        m: {"median_us": round(statistics.median(t) * 1e6, 2), "min_us": round(min(t) * 1e6, 2)}
        for m, t in times.items()
    }
    out = {"device": str(mx.default_device()), "reps": args.reps, "size": args.size, "results": res}
    for m, r in res.items():
        print(f"{m:12s} median {r['median_us']:8.2f} us  min {r['min_us']:8.2f} us")
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
