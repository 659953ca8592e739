"""Device time of hf2q's CUDA kernels by launch variant, read from a kernel trace (CUDA only).

Why: ``node_cost.py`` times a node from the host (build, encode, the whole evaluation), which at
one row is about the host's encoding as much as the device's work, and ``gpu_timeline.py`` traces
whole decoding loops. This times the launch variants that keep every bit against each other on
the device alone: each variant's kernel is evaluated ``--reps`` times by itself, the whole run is
recorded once by torch's profiler (CUPTI's kernel records), and each kernel's duration is taken
from the trace. MLX names a custom kernel by its template arguments, so every variant's launches
can be told apart by name.

- Products (``--products KxN,..``, ``--rows``): ``x @ w.T + add`` (the residual add in the launch,
  as the down and output projections run) for every (column blocks, unrolling) of
  the default launch's warps and, where it applies, the column split:
  the default launch marked. Weights rotate over ``--weights`` copies so that each launch reads
  its weight from memory rather than L2.
- Attention (``--attention``): the row-invariant kernel at the 4B target's shapes (1 and 16 rows
  after 1024 positions) and the drafter's (16 rows over 1040), for each ``HF2Q_ATTN_HEADS``.

    python benchmarks/kernel_trace.py --products 9216x2560,4096x2560 --rows 1,16 --attention \
        --out runs/kernel_trace.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_timeline import chrome_trace, device_events  # noqa: E402

from hf2q.kernels import cuda_attention, cuda_matmul  # noqa: E402


def product_variants(rows: int, K: int, N: int) -> list[tuple[int, ...]]:
    """The launches of ``x @ w.T`` that keep the default's bits: its warps, any column blocks
    and unrolling that divide N, and the column split with 8 warps; the default first."""
    mt, nb, warps, unroll, _ = cuda_matmul._layout(rows, K, N, None, False)
    out = [(nb, warps, unroll)]
    for b in (1, 2, 4, 8):
        for u in (1, 2, 4):
            if (b, warps, u) not in out and N % (8 * b) == 0 and mt * b <= 32:
                out.append((b, warps, u))
    if warps > 1:
        for b in (1, 2):
            if N % (8 * b * 8) == 0:
                out.append((b, warps, 1, 8))
    return out


def _products(shapes, rows_list, weights: int, reps: int):
    """(label, build one node) for every product variant."""
    jobs = []
    for K, N in shapes:
        ws = [mx.random.normal((N, K)).astype(mx.bfloat16) * 0.02 for _ in range(weights)]
        mx.eval(ws)
        for rows in rows_list:
            x = mx.random.normal((rows, K)).astype(mx.bfloat16)
            add = mx.random.normal((rows, N)).astype(mx.bfloat16)
            mx.eval(x, add)
            for i, tune in enumerate(product_variants(rows, K, N)):
                label = f"mm K={K} N={N} rows={rows} tune={tune}" + (" (default)" if i == 0 else "")

                def node(r, tune=tune, x=x, add=add, ws=ws):
                    return cuda_matmul.small_matmul_cuda(x, ws[r % len(ws)], tune=tune, add=add)

                jobs.append((label, node))
    return jobs


#: (name, query heads, KV heads, head size, causal, rows, positions before the rows).
ATTENTION = [
    ("target", 16, 4, 256, True, 1, 1024),
    ("target", 16, 4, 256, True, 16, 1024),
    ("drafter", 32, 8, 128, False, 16, 1024),
]


def _attention(heads: list[int], caches: int):
    jobs = []
    for name, nq, nkv, D, causal, L, pos in ATTENTION:
        cap = -(-(pos + L) // 256) * 256
        ks = [mx.random.normal((1, nkv, cap, D)).astype(mx.bfloat16) for _ in range(caches)]
        vs = [mx.random.normal((1, nkv, cap, D)).astype(mx.bfloat16) for _ in range(caches)]
        q = mx.random.normal((1, nq, L, D)).astype(mx.bfloat16)
        mx.eval(ks, vs, q)
        off = mx.array([pos], dtype=mx.int32)
        for hb in heads:

            def node(r, hb=hb, q=q, ks=ks, vs=vs, off=off, causal=causal, D=D):
                os.environ[cuda_attention.HEADS_ENV] = str(hb)
                # the uncompiled launch: the setting is read as the launch is built
                return cuda_attention._launch(
                    q, ks[r % len(ks)], vs[r % len(vs)], off, scale=D**-0.5, window=0, causal=causal
                )

            jobs.append((f"attention {name} rows={L} positions={pos} heads_per_block={hb}", node))
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--products", default="", help="KxN shapes, e.g. 9216x2560,4096x2560")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--weights", type=int, default=3, help="weight copies a shape rotates over")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--heads", default="1,2,4", help="HF2Q_ATTN_HEADS values (--attention)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        raise SystemExit("kernel_trace.py needs MLX's CUDA backend")
    import torch
    from torch.profiler import ProfilerActivity, profile

    mx.random.seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.products.split(",") if s]
    jobs = _products(shapes, [int(r) for r in args.rows.split(",")], args.weights, args.reps)
    if args.attention:
        jobs += _attention([int(h) for h in args.heads.split(",")], args.weights)
    for _, node in jobs:  # compile every kernel before the trace
        mx.eval(node(0))
    mx.synchronize()
    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    for _, node in jobs:
        for r in range(args.reps):
            mx.eval(node(r))
        mx.synchronize()
    torch.cuda.synchronize()
    prof.stop()
    events = device_events(chrome_trace(prof), cats=("kernel",))
    # The jobs ran one after another: the i-th job's kernels are the ones named after hf2q's
    # kernels in order, reps launches (or 2 x reps for the attention's part and merge) a job.
    ours = [e for e in events if "hf2q" in e[2]]
    results, i = [], 0
    for label, _ in jobs:
        per = 1 if label.startswith("mm ") else None
        if per is None:  # attention: one launch or a part and a merge per node
            per = 2 if any("row_attention_part" in e[2] for e in ours[i : i + 2]) else 1
        mine = ours[i : i + per * args.reps]
        i += per * args.reps
        total = [sum(d for _, d, _ in mine[j * per : (j + 1) * per]) for j in range(args.reps)]
        row = {
            "job": label,
            "kernels": sorted({n.split("(")[0] for _, _, n in mine}),
            "us_median": round(statistics.median(total), 2),
            "us_min": round(min(total), 2),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"reps": args.reps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
