"""Which DFlash block size is fastest for `hf2q generate` here: fixed sizes, ``auto`` and plain
decoding, each as a user runs it, one process per run, alternating.

Runs ``python -m hf2q generate --json -n TOKENS ARM PROMPT`` on the embedded demo pair (or
``--model`` / ``--draft``) for each arm of ``--arms`` (``--no-dflash``, ``-b 16``, ``-b auto``,
...) and each prompt (the pair's default prompt and the first ``--prompts - 1`` of ``hf2q
bench``'s built-in set), in turn, ``--runs`` times after one warm-up round. Reports each arm's
generation tok/s (prefill excluded) per prompt (median, min-max), the mean of those medians over
the prompts, tau, the rounds each size ran (auto), and whether every arm and run gave a prompt the
same tokens (greedy: they must).

    python benchmarks/block_size_ab.py --tokens 128 --runs 3 --out ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dtype_ab import generate_json  # noqa: E402
from quant_dtype import emit  # noqa: E402

ARMS = "--no-dflash;-b 16;-b 4;-b auto"


def main(argv: list[str] | None = None) -> int:
    from hf2q.runtime.bench import BUILTIN_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=ARMS, help=f"';'-separated generate options ({ARMS!r})")
    ap.add_argument("--prompts", type=int, default=4, help="the default prompt + built-in ones")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(";") if a.strip()]
    prompts: list[str | None] = [None, *BUILTIN_PROMPTS[: max(0, args.prompts - 1)]]
    tps: dict[str, dict[str, list[float]]] = {a: {} for a in arms}
    last: dict[str, dict[str, dict]] = {a: {} for a in arms}
    tokens: dict[str, set] = {}
    for r in range(args.runs + 1):  # round 0 warms up
        for i, prompt in enumerate(prompts):
            name = "default" if prompt is None else f"builtin {i - 1}"
            for arm in arms:
                rec = generate_json(arm.split(), args.tokens, args.model, args.draft, prompt)
                last[arm][name] = rec
                tokens.setdefault(name, set()).add(tuple(rec["tokens"]))
                if r:
                    tps[arm].setdefault(name, []).append(rec["generation_tps"])
    medians = {a: {p: statistics.median(v) for p, v in by.items()} for a, by in tps.items()}
    report = {
        "command": f"python -m hf2q generate --json -n {args.tokens} ARM [PROMPT]",
        "tokens": args.tokens,
        "runs": args.runs,
        "prompts": [p if p is not None else "(the pair's default)" for p in prompts],
        "tokens_per_s": {a: {p: round(v, 1) for p, v in m.items()} for a, m in medians.items()},
        "tokens_per_s_min_max": {
            a: {p: [round(min(v), 1), round(max(v), 1)] for p, v in by.items()}
            for a, by in tps.items()
        },
        "mean_over_prompts": {a: round(statistics.mean(m.values()), 1) for a, m in medians.items()},
        "tau": {a: {p: rec.get("tau") for p, rec in by.items()} for a, by in last.items()},
        "block_sizes": {
            a: {p: rec.get("block_sizes") for p, rec in by.items()}
            for a, by in last.items()
            if any(rec.get("block_sizes") for rec in by.values())
        },
        "blas": next(iter(next(iter(last.values())).values())).get("blas"),
        "same_tokens_every_arm_and_run": {p: len(t) == 1 for p, t in tokens.items()},
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
