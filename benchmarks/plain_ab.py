"""Plain decoding's time per token with a switch off and on, alternating in one process.

Why: on the lent GPU machines the same code's step time varied 4.8-7.3 ms between processes
(docs/BENCHMARKS.md, "H200, session 15"), so a switch is judged here by alternating its values
within one process, run after run, and comparing medians. Default: ``HF2Q_COMPILE_FORWARD`` (a
whole decode step as one compiled graph) on the random Qwen3.5-4B-shaped target; every run's
tokens are checked against the first value's.

Usage (GPU):
    python3 benchmarks/plain_ab.py --synthetic 4b --tokens 128 --runs 5
    python3 benchmarks/plain_ab.py --env HF2Q_SMALL_MM --values 1,0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("small", "4b"), default="4b")
    ap.add_argument("--env", default="HF2Q_COMPILE_FORWARD")
    ap.add_argument("--values", default="0,1")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per value (after a warm-up)")
    ap.add_argument(
        "--runners", action="store_true", help="the compiled runners as the path here (CPU)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import mlx.core as mx
    from slots_synthetic import synthetic_pair

    import hf2q.kernels.layers as layers
    from hf2q.runtime.dflash import plain_generate, run

    if args.runners:  # in this process only
        layers.decode_runners_active = lambda: True
    pair = synthetic_pair(args.synthetic)
    vocab = pair.target.args.vocab_size
    prompt = mx.random.randint(0, vocab, (args.prompt_tokens,), key=mx.random.key(1)).tolist()
    values = args.values.split(",")
    ms: dict[str, list[float]] = {v: [] for v in values}
    tokens: dict[str, list[int]] = {}
    for r in range(args.runs + 1):  # run 0 compiles
        for v in values:
            os.environ[args.env] = v
            s = run(plain_generate(pair.target, prompt, max_tokens=args.tokens))
            if r:
                ms[v].append(s.decode_time / max(s.generation_tokens - 1, 1) * 1e3)
            tokens.setdefault(v, s.tokens)
    report = {
        "model": f"synthetic {args.synthetic}",
        "device": str(mx.default_device()),
        "env": args.env,
        "tokens": args.tokens,
        "runs": args.runs,
        "ms_per_token": {v: round(statistics.median(x), 4) for v, x in ms.items()},
        "ms_per_token_min_max": {v: [round(min(x), 4), round(max(x), 4)] for v, x in ms.items()},
        "same_tokens": all(tokens[v] == tokens[values[0]] for v in values),
    }
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
