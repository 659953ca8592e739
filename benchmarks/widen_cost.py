"""What a draft vocabulary's widening costs next to its product, on the default device.

``--draft-vocab K`` drafts from K rows of the head and widens the logits back to the whole
vocabulary (-inf elsewhere) before the draft's argmax / softmax. Session 51's H100 gave four
slots' rounds only 0.09 ms faster at K 32768 than with the whole head, where reading 1.1 GB fewer
head bytes a draft should save about 0.3 ms. This times, for a head of ``--vocab`` rows at
``--hidden`` (bf16 or ``--dtype``, random) and draft rows M (15: one slot's block of 16; 60: four slots'):

- ``head``: the whole head's product and the argmax (what a draft does without a vocabulary);
- ``rows``: the K rows' product and the argmax (the product alone, as if widening were free);
- ``rows_map``: the K rows' product, argmax, and the ids looked up (greedy without widening);
- ``rows_widen``: the K rows' product, widened (concatenate -inf, take), argmax (hf2q today);
- ``widen``: the widening and argmax of ready K-wide logits alone;

each eager and under ``mx.compile``; medians of ``--reps`` timings of ``--iters`` calls each.

Usage: python3 benchmarks/widen_cost.py [--vocab 248320 --hidden 2560 --k 32768] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--k", type=int, default=32768)
    ap.add_argument("--rows", default="15,60")
    ap.add_argument("--dtype", default="bfloat16", help="the head's dtype (float32: a CPU's)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import mlx.core as mx
    import numpy as np

    mx.random.seed(0)
    V, H, K = args.vocab, args.hidden, args.k
    dt = getattr(mx, args.dtype)
    w = (mx.random.normal((V, H)) * H**-0.5).astype(dt)
    ids_np = np.arange(K, dtype=np.int32)
    rows_w = w[:K]
    index = np.full(V, K, dtype=np.int32)
    index[ids_np] = np.arange(K, dtype=np.int32)
    widen_ix, ids = mx.array(index), mx.array(ids_np)
    wt, rows_wt = w.T, rows_w.T
    mx.eval(w, rows_w, widen_ix, ids, wt, rows_wt)

    def widen(y):
        fill = mx.full((*y.shape[:-1], 1), -mx.inf, dtype=y.dtype)
        return mx.take(mx.concatenate([y, fill], axis=-1), widen_ix, axis=-1)

    fns = {
        "head": lambda x: mx.argmax(x @ wt, axis=-1),
        "rows": lambda x: mx.argmax(x @ rows_wt, axis=-1),
        "rows_map": lambda x: mx.take(ids, mx.argmax(x @ rows_wt, axis=-1)),
        "rows_widen": lambda x: mx.argmax(widen(x @ rows_wt), axis=-1),
        "widen": lambda y: mx.argmax(widen(y), axis=-1),
    }
    out = {"device": str(mx.default_device()), "dtype": args.dtype, "vocab": V, "hidden": H}
    out.update(k=K, rows=[])
    for M in (int(m) for m in args.rows.split(",")):
        x = mx.random.normal((M, H)).astype(dt)
        y = x @ rows_wt
        mx.eval(x, y)
        for name, fn in fns.items():
            for compiled in (False, True):
                f = mx.compile(fn) if compiled else fn
                arg = y if name == "widen" else x
                ref = np.array(fns["head" if name == "head" else "rows_map"](x))
                got = np.array(f(arg))
                if name != "head" and name != "rows" and not (got == ref).all():
                    raise SystemExit(f"{name}: argmax ids differ from the rows' mapped ids")
                for _ in range(3):
                    mx.eval(f(arg))
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        mx.eval(f(arg))
                    times.append((time.perf_counter() - t0) / args.iters * 1e6)
                row = {
                    "M": M,
                    "fn": name,
                    "compiled": compiled,
                    "us_median": round(statistics.median(times), 1),
                    "us_min": round(min(times), 1),
                    "us_max": round(max(times), 1),
                }
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
