"""What attention over a KV cache costs per call, by context length (MLX, any backend).

Why: on the H200 a plain decode step of the 4B-shaped target after a 1024-token prompt took about
1.6 ms more than after a 64-token prompt, in one process of one call (session 20, run 3), and
only the 8 attention layers' work grows with the context. This times one attention layer's
attention at Qwen3.5-4B's shapes (16 query / 4 key-value heads of 256) for a decode step (1 row)
and a verify block (16 rows) at each context length: hf2q's row-invariant kernel on CUDA (what
decoding and verifying run there) and MLX's ``scaled_dot_product_attention`` (every backend).
Each kind builds ``--ops`` independent calls, each over its own cache buffers, and is timed as
``node_cost.py`` times a node (build, encode, total per call; medians of ``--reps``, the kinds
taking turns).

    python benchmarks/attn_cost.py --contexts 64,256,1024,4096 --out runs/attn_cost.json

``--shape drafter`` times the 5-layer drafter's attention instead (32 query / 8 key-value heads of
128, the block's rows seeing the whole block: not causal). ``--baseline FILE`` also times the
kernel of another version of ``hf2q/kernels/cuda_attention.py`` (a copy of that file) side by side
and reports whether its outputs equal the current kernel's bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_cost import _cuda, _time_all  # noqa: E402

#: (query heads, key-value heads, head size, causal) of each shape.
SHAPES = {"target": (16, 4, 256, True), "drafter": (32, 8, 128, False)}


def _load_module(path: str):
    spec = importlib.util.spec_from_file_location("attn_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kinds(qs, ks, vs, context: int, rows: int, cuda: bool, shape: str, baseline=None) -> dict:
    """name -> function building one attention node per cache."""
    _, _, head_dim, causal = SHAPES[shape]
    scale = head_dim**-0.5
    offset = context - rows  # the cache holds the block's own keys too, as after an update
    mask = "causal" if rows > 1 and causal else None
    kinds = {
        "mlx_sdpa": lambda: [
            mx.fast.scaled_dot_product_attention(
                q, k[:, :, :context], v[:, :, :context], scale=scale, mask=mask
            )
            for q, k, v in zip(qs, ks, vs)
        ]
    }
    if cuda:
        from hf2q.kernels.cuda_attention import row_attention_cuda

        kinds["hf2q_row_attention"] = lambda: [
            row_attention_cuda(q, k, v, offset, scale, causal=causal) for q, k, v in zip(qs, ks, vs)
        ]
        if baseline is not None:
            kinds["baseline_row_attention"] = lambda: [
                baseline.row_attention_cuda(q, k, v, offset, scale, causal=causal)
                for q, k, v in zip(qs, ks, vs)
            ]
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="64,256,1024,4096")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--ops", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="target")
    ap.add_argument("--baseline", help="another version's cuda_attention.py, timed side by side")
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = _cuda()
    baseline = _load_module(args.baseline) if args.baseline and cuda else None
    n_q, n_kv, head_dim, _ = SHAPES[args.shape]
    dtype = mx.bfloat16
    results = []
    mx.random.seed(0)
    for context in [int(c) for c in args.contexts.split(",")]:
        # mlx-lm's KVCache grows its buffers in steps of 256 positions: the kernel reads a buffer
        # of that size, MLX's attention the filled part.
        cap = -(-context // 256) * 256
        ks = [mx.random.normal((1, n_kv, cap, head_dim)).astype(dtype) for _ in range(args.ops)]
        vs = [mx.random.normal((1, n_kv, cap, head_dim)).astype(dtype) for _ in range(args.ops)]
        mx.eval(ks, vs)
        for rows in [int(r) for r in args.rows.split(",")]:
            qs = [mx.random.normal((1, n_q, rows, head_dim)).astype(dtype) for _ in range(args.ops)]
            mx.eval(qs)
            kinds = _kinds(qs, ks, vs, context, rows, cuda, args.shape, baseline)
            same = None
            if baseline is not None:  # the two versions' outputs, bit for bit
                a, b = kinds["hf2q_row_attention"](), kinds["baseline_row_attention"]()
                same = all(mx.array_equal(x, y).item() for x, y in zip(a, b))
            for kind, timed in _time_all(kinds, args.reps).items():
                r = {"shape": args.shape, "context": context, "rows": rows, "kind": kind, **timed}
                if same is not None and kind != "mlx_sdpa":
                    r["same_bits_as_baseline"] = same
                results.append(r)
                print(json.dumps(r), flush=True)
    out = {"backend": "cuda" if cuda else "cpu", "ops": args.ops, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
