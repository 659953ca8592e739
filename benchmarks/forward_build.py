"""Host time to build one target forward's graph through hf2q's compiled layer runners.

Why: on an H200 a Qwen3.5-4B-sized plain step or DFlash round is bound by the host (session 15,
docs/BENCHMARKS.md: about 2.0 ms of Python to build a 32-layer decode step's graph, 2.3 ms for a
verify's, besides MLX encoding the nodes). That Python is the same code on every backend, so this
script measures it anywhere: it runs ``TargetModel.forward`` through the layer functions plain
decoding (``fast_layer_fn``) and verify (``verify_forward`` with the runners) use on CUDA, times
only the call that builds the graph, then evaluates it untimed, and reports medians; also the
decode step as one compiled graph (``hf2q.kernels.forward.CompiledDecode``,
``HF2Q_COMPILE_FORWARD=1``).

With ``--draft``: instead, the drafter's forward of a full block (what every DFlash round
drafts), layer by layer (``HF2Q_COMPILE_DRAFT=0``: the fast layers on CUDA, the layer calls
elsewhere) against one compiled graph (``=1``, ``hf2q.runtime.draft_graph.CompiledDraft``), each
call's graph building timed, for one sequence and for ``--rows`` slot rows with the kept counts
on the device (lagged rounds); the new context rows cycle through 1..block as acceptance would.

With ``--retrace N``: instead, N verify blocks through the verify graph (``CompiledVerify``,
forced, the runners made the path as on CUDA) from ``--prompt-tokens`` positions, each call's
graph building timed; the calls that found a new KV buffer size (a new trace of the whole model:
a graph's trace depends on its buffers' shapes) are reported apart from the replays. The graphs'
buffers grow by ``hf2q.kernels.forward.graph_capacity``.

Usage (a random-weight pair of benchmarks/slots_synthetic.py's shapes):
    python benchmarks/forward_build.py --synthetic small --reps 200
    python benchmarks/forward_build.py --synthetic small --retrace 40
    python benchmarks/forward_build.py --synthetic small --draft --reps 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("small", "4b"), default="small")
    ap.add_argument("--reps", type=int, default=200, help="timed forwards per kind")
    ap.add_argument("--block", type=int, default=16, help="verify block length")
    ap.add_argument("--retrace", type=int, default=0, help="N: time N graph verifies instead")
    ap.add_argument("--draft", action="store_true", help="time the drafter's forward instead")
    ap.add_argument("--rows", type=int, default=4, help="slot rows of --draft's batched case")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="positions before --retrace")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from slots_synthetic import synthetic_pair

    from hf2q.kernels import select
    from hf2q.kernels.forward import CompiledDecode
    from hf2q.kernels.layers import fast_layer_fn
    from hf2q.runtime.cache import make_target_cache
    from hf2q.runtime.verify import verify_forward

    pair = synthetic_pair(args.synthetic)
    if args.retrace:
        return retrace(pair, args)
    if args.draft:
        return draft(pair, args)
    target = pair.target
    ids = pair.drafter.config.target_layer_ids
    vocab = target.args.vocab_size
    prompt = mx.random.randint(0, vocab, (1, 32), key=mx.random.key(0)).astype(mx.int32)
    results = {}

    # Plain decoding's forward: one token through the runners (as decode_layer_fn on CUDA).
    cache = target.make_cache()
    target.forward(prompt, cache)
    mx.eval([c.state for c in cache])
    times = []
    for i in range(args.reps + 5):
        tok = mx.array([[i % vocab]], dtype=mx.int32)
        tic = time.perf_counter()
        fn = fast_layer_fn(fuse_proj=select.fuse_proj_enabled(), mm=select.small_mm_enabled())
        logits, _ = target.forward(tok, cache, layer_fn=fn)
        times.append(time.perf_counter() - tic)
        mx.eval(logits, [c.state for c in cache])
    results["decode"] = times[5:]

    # The same step as one compiled graph (HF2Q_COMPILE_FORWARD=1, hf2q.kernels.forward).
    cache = target.make_cache()
    target.forward(prompt, cache)
    mx.eval([c.state for c in cache])
    whole = CompiledDecode(
        target,
        fuse_proj=select.fuse_proj_enabled(),
        mm=select.small_mm_enabled(),
        rows=select.row_attention_enabled(),
    )
    times = []
    for i in range(args.reps + 5):
        tok = mx.array([[i % vocab]], dtype=mx.int32)
        tic = time.perf_counter()
        logits = whole(tok, cache)
        times.append(time.perf_counter() - tic)
        mx.eval(logits, [c.state for c in cache])
    results["decode_whole"] = times[5:]

    # Verify's forward: a block through the runners (states recorded), rolled back each time.
    cache = make_target_cache(target)
    target.forward(prompt, cache)
    mx.eval([c.state for c in cache])
    times = []
    for i in range(args.reps + 5):
        block = mx.array([[(i + j) % vocab for j in range(args.block)]], dtype=mx.int32)
        tic = time.perf_counter()
        logits, feats = verify_forward(target, block, cache, capture=ids, runners=True)
        times.append(time.perf_counter() - tic)
        mx.eval(logits, feats)
        cache.rollback(1)
        mx.eval([c.state for c in cache])
    results["verify"] = times[5:]

    report = {
        "model": f"synthetic {args.synthetic}",
        "layers": target.num_layers,
        "device": str(mx.default_device()),
        "reps": args.reps,
    }
    for kind, ts in results.items():
        ms = sorted(t * 1e3 for t in ts)
        report[f"{kind}_build_ms"] = round(statistics.median(ms), 4)
        report[f"{kind}_build_ms_p10_p90"] = [
            round(ms[len(ms) // 10], 4),
            round(ms[(9 * len(ms)) // 10], 4),
        ]
        report[f"{kind}_build_us_per_layer"] = round(
            statistics.median(ms) * 1e3 / target.num_layers, 1
        )
    text = json.dumps(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def draft(pair, args) -> int:
    """``--draft``: the drafter forward's build time, layer by layer against one graph."""
    import os

    from hf2q.kernels import select
    from hf2q.runtime.slot_cache import make_slot_draft_cache

    drafter = pair.drafter
    B, F = args.block, len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    dtype = pair.target.dtype
    report = {
        "model": f"synthetic {args.synthetic}",
        "drafter_layers": len(drafter.layers),
        "device": str(mx.default_device()),
        "block": B,
        "reps": args.reps,
    }
    for rows in (1, args.rows):
        for kind, flag in (("layers", "0"), ("graph", "1")):
            os.environ[select.COMPILE_DRAFT_ENV] = flag
            mx.random.seed(3)
            if rows == 1:
                cache = drafter.make_cache()
            else:
                cache = make_slot_draft_cache(drafter, rows)
            drafter.add_context(mx.random.normal((rows, 32, F)).astype(dtype), cache)
            mx.eval([c.state for c in cache])
            if rows > 1:
                for c in cache:
                    c.lagged = True
            graph = drafter.graph(B)  # None with the switch off: the layer path
            times = []
            for i in range(args.reps + 5):
                S = 1 + (7 * i) % B  # the kept rows of the last round
                feats = mx.random.normal((rows, B, F)).astype(dtype)
                if rows == 1:
                    feats = feats[:, :S]
                else:  # lagged rounds: every row's features, its count on the device
                    counts = mx.array([1 + (S + r) % B for r in range(rows)], dtype=mx.int32)
                    mx.eval(counts)
                block = mx.array(
                    [[i % 97] + [drafter.mask_token_id] * (B - 1)] * rows, dtype=mx.int32
                )
                mx.eval(feats, block)
                tic = time.perf_counter()
                if rows > 1:
                    for c in cache:
                        c.prepare(lengths=counts)
                logits = drafter(block, feats, cache, graph)
                times.append(time.perf_counter() - tic)
                mx.eval([c.state for c in cache])  # (the logits: not needed to go on)
                del logits
            ms = sorted(t * 1e3 for t in times[5:])
            name = f"{kind}_rows{rows}"
            report[f"{name}_build_ms"] = round(statistics.median(ms), 4)
            report[f"{name}_build_ms_p10_p90"] = [
                round(ms[len(ms) // 10], 4),
                round(ms[(9 * len(ms)) // 10], 4),
            ]
    os.environ.pop(select.COMPILE_DRAFT_ENV, None)
    text = json.dumps(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def retrace(pair, args) -> int:
    """``--retrace``: graph verifies' build times, new traces apart from replays."""
    import os

    from hf2q.kernels import layers, select
    from hf2q.runtime import verify
    from hf2q.runtime.cache import make_target_cache
    from hf2q.runtime.dflash import prefill

    layers.decode_runners_active = verify.decode_runners_active = lambda: True  # this process
    os.environ[select.COMPILE_VERIFY_ENV] = "1"
    target, ids = pair.target, pair.drafter.config.target_layer_ids
    vocab = target.args.vocab_size
    cache = make_target_cache(target.model)
    prefill(target, [(7 * i) % vocab for i in range(args.prompt_tokens)], cache)
    mx.eval(cache.state)
    whole = verify.whole_verify(target, cache, args.block, ids)
    seen: set[int] = set()
    trace_ms, replay_ms = [], []
    for r in range(args.retrace):
        block = mx.array([[(r * 31 + j) % vocab for j in range(args.block)]], dtype=mx.int32)
        tic = time.perf_counter()
        out = verify.verify_forward(target, block, cache, capture=ids, whole=whole)
        ms = (time.perf_counter() - tic) * 1e3
        mx.eval(out)
        cache.rollback(args.block)
        mx.eval(cache.state)
        size = next(c.keys.shape[2] for c in cache if hasattr(c, "keys"))
        (replay_ms if size in seen else trace_ms).append(ms)
        seen.add(size)
    report = {
        "model": f"synthetic {args.synthetic}",
        "layers": target.num_layers,
        "device": str(mx.default_device()),
        "rounds": args.retrace,
        "positions": [args.prompt_tokens, cache.offset],
        "buffer_sizes": sorted(seen),
        "trace_ms": [round(t, 2) for t in trace_ms],
        "replay_ms_median": round(statistics.median(replay_ms), 3) if replay_ms else None,
    }
    text = json.dumps(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
