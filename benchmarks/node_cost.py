"""What one graph node costs the host and the device, by kind of node (MLX, any backend).

For each kind (MLX's matmul, hf2q's small-M tensor-core matmul on CUDA, an elementwise add) and
each shape, builds ``--ops`` nodes over already evaluated inputs (every node its own weight, so
the device reads from memory, not cache; independent, or one after another with ``--chain``),
then times, per node: building the graph in Python (``build``), handing it to MLX (``mx.async_eval``: on CUDA the host encodes every node into
CUDA graphs here; ``encode``) and the whole evaluation until the results are ready (``total``).
``total`` is the device time per node when the device is the slower side, so ``GB/s`` (weight
bytes over ``total``) is the effective bandwidth of the product. Medians of ``--reps``, the
kinds taking turns within each rep.

Independent nodes can run side by side on the device (a CUDA graph orders only what depends on
what), so a launch of few thread blocks looks better there than where a layer's products run one
after another: session 56's tune timed gate and up at 64 rows 13% faster with a column split
that made the 4-slot round 78% slower. ``--chain`` makes each node add the previous node's
output (hf2q's kernel with its residual in the launch, ``mx.addmm`` for MLX's, one more add for
the elementwise kind): the nodes then run one at a time, as in a forward.

On CUDA it also checks hf2q's kernel against a float32 product (relative error) and that a row's
result does not depend on how many rows were computed with it (bit-equal).

    python benchmarks/node_cost.py --out runs/node_cost.json
    python benchmarks/node_cost.py --rows 64 --shapes 4b --ops 16 --reps 15 --tune --chain \
        --cands "4,8,4;2,8,1,4" --out runs/tune64.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

DEMO = [(256, 768), (768, 256), (256, 1024)]
SHAPE_4B = [(2560, 9216), (9216, 2560), (2560, 2560)]
#: Qwen3.5-4B's tied head (hidden 2560, vocab 248320): 1.27 GB in bf16, so at most 2 weights.
HEAD_4B = [(2560, 248320)]


def _cuda() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def _once(make_ops) -> tuple[float, float, float, int]:
    """(build, encode, total) seconds of one evaluation of ``make_ops()``'s nodes, and their count."""
    mx.synchronize()
    t0 = time.perf_counter()
    outs = make_ops()
    t1 = time.perf_counter()
    mx.async_eval(outs)
    t2 = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t1, len(outs)


def _time_all(kinds: dict, reps: int, per_node: bool = True) -> dict:
    """Per kind, medians over ``reps`` of build / encode / total us a node (``per_node``, else
    an evaluation). The kinds take turns within each rep (each rep starting one kind later),
    after one unrecorded evaluation each (compilation): a drift of the device over the run
    (clocks, other work) then spreads over every kind alike instead of favouring the first ones
    timed."""
    names = list(kinds)
    for name in names:
        _once(kinds[name])
    times: dict = {name: [] for name in names}
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            times[name].append(_once(kinds[name]))
    out = {}
    for name, ts in times.items():
        n = ts[0][3] if per_node else 1
        out[name] = {
            key: round(statistics.median(t[j] for t in ts) / n * 1e6, 2)
            for j, key in enumerate(("build_us", "encode_us", "total_us"))
        }
    return out


def _nodes(node, ws: list, chain: bool) -> list:
    """``node(w, prev)`` for each weight: ``prev`` None (independent nodes), or with ``chain``
    the previous node's output, which the node must add (so it waits for it)."""
    outs: list = []
    for w in ws:
        outs.append(node(w, outs[-1] if chain and outs else None))
    return outs


def _kinds(
    x: mx.array,
    ws: list,
    cuda: bool,
    tune: bool,
    only: list | None = None,
    chain: bool = False,
) -> dict:
    """What to time: name -> function building one node per weight (``only``: of the tune's
    launch shapes, these, with the default's warps; ``chain``: each node adds the previous
    one's output, see the module's docstring)."""
    M = x.shape[0]

    def mlx(w, prev):
        return x @ w.T if prev is None else mx.addmm(prev, x, w.T)

    def add(w, prev):
        return x[:, :1] + w[:M] if prev is None else prev + w[:M]

    kinds = {
        "mlx_matmul": lambda: _nodes(mlx, ws, chain),
        "add": lambda: _nodes(add, ws, chain),
    }
    if not cuda:
        return kinds
    from hf2q.kernels.cuda_matmul import small_matmul_cuda, supported

    if supported(x, ws[0]) is not None:
        return kinds

    def hf2q(t):
        return lambda w, prev: small_matmul_cuda(x, w, tune=t, add=prev)

    kinds["hf2q_small_mm"] = lambda: _nodes(hf2q(None), ws, chain)
    if tune:  # launch shapes (column blocks per thread block, warps, chunk-loop unrolling) with
        # the default's warps: the choices that keep every row's bits
        from hf2q.kernels.cuda_matmul import launch_shape

        mt, _, warps, _ = launch_shape(M, x.shape[-1], ws[0].shape[0])
        cands = [(nb, warps, unroll) for nb in (1, 2, 4, 8) for unroll in (1, 2, 4)]
        if warps > 1:  # the column split (a fourth value: its warps a block)
            cands += [(nb, warps, 1, 8) for nb in (1, 2)]
        for t in cands if only is None else [(c[0], warps, *c[2:]) for c in only]:
            # (8 x 8 x 4 accumulators would not fit in registers)
            width = 8 * t[0] * (t[3] if len(t) >= 4 else 1)
            if ws[0].shape[0] % width == 0 and mt * t[0] <= 32:
                kinds[f"hf2q_small_mm{t}"] = lambda t=t: _nodes(hf2q(t), ws, chain)
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rows", default="1,16,32,128")
    ap.add_argument("--shapes", default="demo,4b", help="demo, 4b and/or head4b (the tied head)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--tune", action="store_true", help="also time the kernel's launch shapes (same bits)"
    )
    ap.add_argument(
        "--cands",
        default=None,
        help="with --tune, only these launch shapes:"
        " 'nb,warps,unroll[,column warps[,chunks ahead]];...'"
        " (warps: the default's, whatever is given, so that the bits stay)",
    )
    ap.add_argument(
        "--chain",
        action="store_true",
        help="each node adds the previous node's output, so the nodes run one at a time",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    cuda = _cuda()
    chosen = args.shapes.split(",")
    shapes = (DEMO if "demo" in chosen else []) + (SHAPE_4B if "4b" in chosen else [])
    shapes += HEAD_4B if "head4b" in chosen else []
    rows_list = [int(r) for r in args.rows.split(",")]
    only = None
    if args.cands:
        only = [tuple(int(v) for v in c.split(",")) for c in args.cands.split(";")]
        if any(len(c) not in (3, 4, 5) for c in only):
            raise SystemExit(
                f"--cands {args.cands!r}: give 'nb,warps,unroll[,column warps[,chunks ahead]]'"
                " per launch"
            )
    if cuda:
        from hf2q.kernels.cuda_matmul import small_matmul_cuda, supported
    else:
        supported = None
    results, checks = [], []
    mx.random.seed(0)
    for K, N in shapes:
        ops = min(args.ops, 2) if N * K > 1 << 28 else args.ops
        ws = [(mx.random.normal((N, K)) * K**-0.5).astype(dtype) for _ in range(ops)]
        mx.eval(ws)
        for M in rows_list:
            x = mx.random.normal((M, K)).astype(dtype)
            mx.eval(x)
            kinds = _kinds(x, ws, cuda, args.tune, only, args.chain)
            for kind, timed in _time_all(kinds, args.reps).items():
                r = {"K": K, "N": N, "rows": M, "kind": kind, **timed}
                if kind != "add":
                    r["GB_s"] = round(N * K * x.itemsize / (r["total_us"] * 1e-6) / 1e9, 1)
                results.append(r)
                print(json.dumps(r), flush=True)
            if supported is not None and supported(x, ws[0]) is None:
                ref = x.astype(mx.float32) @ ws[0].astype(mx.float32).T
                got = small_matmul_cuda(x, ws[0]).astype(mx.float32)
                base = (x @ ws[0].T).astype(mx.float32)
                scale = mx.abs(ref).max()
                one = small_matmul_cuda(x[-1:], ws[0])
                c = {
                    "K": K,
                    "N": N,
                    "rows": M,
                    "hf2q_rel_err": (mx.abs(got - ref).max() / scale).item(),
                    "mlx_rel_err": (mx.abs(base - ref).max() / scale).item(),
                    "last_row_alone_bit_equal": bool(mx.array_equal(one[0], got[-1].astype(dtype))),
                }
                checks.append(c)
                print(json.dumps(c), flush=True)
    out = {
        "backend": "cuda" if cuda else "cpu",
        "dtype": args.dtype,
        "ops": args.ops,
        "chain": args.chain,
        "results": results,
        "checks": checks,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
