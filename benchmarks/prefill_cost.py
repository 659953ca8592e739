"""Prefill time with and without ``HF2Q_PREFILL_RUNNERS`` (alternating in one process).

Why: off Apple GPUs mlx-lm runs a prompt chunk's Gated-DeltaNet recurrence as a Python loop of
small ops per position (a 1024-token prompt of the Qwen3.5-4B shape: about 640 thousand graph
nodes, 1.5 s on an H200, docs/BENCHMARKS.md session 15). ``HF2Q_PREFILL_RUNNERS=1`` sends the
chunks through hf2q's compiled runners (on CUDA, one fused kernel per layer). This script times
``hf2q.runtime.dflash.prefill`` (target and drafter context, as a DFlash generation starts) both
ways, alternating so that a drifting host affects both alike, and says whether the first token
agrees. The switch takes effect only where plain decoding runs the runners (CUDA); ``--runners``
makes them the path on any device, to check this script on a CPU.

Usage (GPU):
    python3 benchmarks/prefill_cost.py --synthetic 4b --prompt-tokens 1024,4096 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("small", "4b"), default="4b")
    ap.add_argument("--prompt-tokens", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runners", action="store_true", help="the runners as the path here (CPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from slots_synthetic import synthetic_pair

    import hf2q.kernels.layers as layers
    from hf2q.kernels import select
    from hf2q.runtime.cache import make_target_cache
    from hf2q.runtime.dflash import prefill

    if args.runners:  # in this process only
        layers.decode_runners_active = lambda: True
    pair = synthetic_pair(args.synthetic)
    target, drafter = pair.target, pair.drafter
    vocab = target.args.vocab_size
    rows = []
    for n in (int(x) for x in args.prompt_tokens.split(",")):
        prompt = mx.random.randint(0, vocab, (n,), key=mx.random.key(n)).tolist()
        seconds: dict[str, list[float]] = {"0": [], "1": []}
        first: dict[str, int] = {}
        for rep in range(args.reps + 1):  # the first round compiles (not reported)
            for mode in ("0", "1"):
                os.environ[select.PREFILL_RUNNERS_ENV] = mode
                cache, dcache = make_target_cache(target), drafter.make_cache()
                mx.synchronize()
                tic = time.perf_counter()
                logits, feats = prefill(target, prompt, cache, drafter=drafter, draft_cache=dcache)
                tok = mx.argmax(logits, axis=-1)
                mx.eval(tok, feats, [c.state for c in cache])
                dt = time.perf_counter() - tic
                if rep:
                    seconds[mode].append(dt)
                first[mode] = int(tok.item())
                del cache, dcache, logits, feats
                mx.clear_cache()
        row = {"prompt_tokens": n, "same_first_token": first["0"] == first["1"]}
        for mode, name in (("0", "layers"), ("1", "runners")):
            med = statistics.median(seconds[mode])
            row[f"{name}_s"] = round(med, 4)
            row[f"{name}_tok_s"] = round(n / med, 1)
        row["speedup"] = round(row["layers_s"] / row["runners_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "model": f"synthetic {args.synthetic}",
        "device": str(mx.default_device()),
        "reps": args.reps,
        "runners_active": layers.decode_runners_active(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
