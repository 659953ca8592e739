"""What restoring a verify's Gated-DeltaNet records costs, per implementation (H200 question).

Why: ``verify_cost.py`` timed the one-launch rollback (``hf2q.kernels.cuda_rollback``) slower
than the per-layer ops it replaces (0.92 vs 0.79 ms at the 4B shape, session 14 run 3) although
it is one graph node against about 120. This times the pieces apart on random records of the
4B shape (24 layers, conv 8192 wide, 32 x 128 x 128 float32 states, T = 16):

* ``ops``: ``GDNRollbackCache.rollback`` per layer (slice views of the states, a contiguous copy
  of the conv rows; a gather per layer for ragged rows);
* ``ops-copy``: the same with the states copied too (what the kernel writes);
* ``kernel``: one launch for all layers; ``kernel-per-layer``: one launch per layer;
* each also as host time only (``async_eval`` returns after encoding).

Usage: ``python benchmarks/rollback_cost.py --rows 1,8 --reps 30 [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q.kernels import cuda_rollback as cr  # noqa: E402
from hf2q.runtime.cache import GDNRollbackCache  # noqa: E402


def _records(L, B, T, K1, C, state_shape, dtype):
    mx.random.seed(0)
    convs = [mx.random.normal((B, K1 + T, C)).astype(dtype) for _ in range(L)]
    states = [mx.random.normal((B, T, *state_shape)) for _ in range(L)]
    mx.eval(convs, states)
    return convs, states


def _ops(convs, states, keep, copy_states: bool):
    """The runtime's per-layer rollback (``GDNRollbackCache.rollback``), states copied or not."""
    n_keep = keep[0] if len(set(keep)) == 1 else keep
    out = []
    for conv, st in zip(convs, states):
        cache = GDNRollbackCache()
        cache.set_record(conv, st)
        cache.rollback(n_keep)
        out += [cache[0], mx.contiguous(cache[1]) if copy_states else cache[1]]
    return out


def _kernel(convs, states, keep, per_layer: bool):
    k = mx.array(keep, dtype=mx.int32)
    if not per_layer:
        a, b = cr.rollback_cuda(convs, states, k)
        return a + b
    out = []
    for c, s in zip(convs, states):
        a, b = cr.rollback_cuda([c], [s], k)
        out += a + b
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for B in [int(x) for x in args.rows.split(",")]:
        convs, states = _records(args.layers, B, 16, 3, 8192, (32, 128, 128), mx.bfloat16)
        keep = [8] * B if B == 1 else [1 + (5 * i) % 16 for i in range(B)]
        rec = (convs, states, keep)
        variants = {
            "ops": lambda r=rec: _ops(*r, False),
            "ops-copy": lambda r=rec: _ops(*r, True),
            "kernel": lambda r=rec: _kernel(*r, False),
            "kernel-per-layer": lambda r=rec: _kernel(*r, True),
        }
        for name, fn in variants.items():
            total, host = [], []
            for i in range(args.reps + 3):
                mx.synchronize()
                t0 = time.perf_counter()
                out = fn()
                mx.async_eval(out)
                t1 = time.perf_counter()
                mx.eval(out)
                mx.synchronize()
                t2 = time.perf_counter()
                if i >= 3:
                    host.append((t1 - t0) * 1e3)
                    total.append((t2 - t0) * 1e3)
                del out
            row = {"total_ms": statistics.median(total), "host_ms": statistics.median(host)}
            results[f"{name}/rows{B}"] = row
            print(
                f"rows {B} {name:18s} total {row['total_ms']:.3f} ms  host {row['host_ms']:.3f} ms"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
