"""Rounds and tau of greedy DFlash with and without lookup drafts, per built-in prompt.

Why: lookup drafts (``hf2q.runtime.lookup``) change how many rounds a generation takes, never its
tokens. This runs plain greedy decoding and DFlash with ``lookup`` off and on for each of the
bench's built-in prompts on one pair, checks that all three give the same tokens, and prints
rounds, tau, the rounds lookup drafted and generation tok/s (tok/s only means something on an
otherwise idle machine; rounds and tau are exact).

Usage: ``python benchmarks/lookup_rounds.py [-m TARGET -d DRAFT] [--tokens 128] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf2q.runtime.bench import BUILTIN_PROMPTS  # noqa: E402
from hf2q.runtime.dflash import dflash_generate, plain_generate, run  # noqa: E402
from hf2q.runtime.pair import encode_prompt, load_pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--draft", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    pair = load_pair(args.model, args.draft)
    rows = []
    total = {False: 0, True: 0}
    for i, text in enumerate(BUILTIN_PROMPTS):
        prompt = encode_prompt(pair.tokenizer, text, chat=pair.chat_default)
        plain = run(plain_generate(pair.target, prompt, max_tokens=args.tokens)).tokens
        row = {"prompt": i, "text": text[:40]}
        for lookup in (False, True):
            s = run(
                dflash_generate(
                    pair.target,
                    pair.drafter,
                    prompt,
                    max_tokens=args.tokens,
                    block_size=args.block_size,
                    lookup=lookup,
                )
            )
            if s.tokens != plain:
                raise SystemExit(f"prompt {i}: DFlash (lookup={lookup}) differs from plain")
            key = "lookup" if lookup else "drafter"
            row[key] = {
                "rounds": s.rounds,
                "tau": round(s.tau, 3),
                "lookup_rounds": s.lookup_rounds,
                "tokens_per_s": round(s.generation_tps, 1),
            }
            total[lookup] += s.rounds
        rows.append(row)
        d, k = row["drafter"], row["lookup"]
        print(
            f"{i} {text[:28]!r:32s} drafter only: {d['rounds']:3d} rounds tau {d['tau']:.2f} "
            f"{d['tokens_per_s']:.0f} tok/s | with lookup: {k['rounds']:3d} rounds tau "
            f"{k['tau']:.2f} ({k['lookup_rounds']} by lookup) {k['tokens_per_s']:.0f} tok/s"
        )
    print(f"rounds over all prompts: drafter only {total[False]}, with lookup {total[True]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
