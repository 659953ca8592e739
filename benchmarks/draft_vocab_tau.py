"""Tokens accepted a round (tau) with a draft vocabulary (``--draft-vocab K``) against the whole
one, on the embedded demo pair's built-in prompts; every run's tokens checked against plain
greedy decoding's.

A draft vocabulary changes only what drafts propose, so the one cost to measure is acceptance
(its speed is the round time, measured on a GPU by plain_ab.py). Drafts by model only (no lookup
rounds), greedy.

A value ``K:hB`` drafts from the head's rows quantized to B bits (``--draft-head-bits``), ``K:dB``
with a copy of the drafter whose layers are quantized to B bits (affine, groups of 64: what
``slots_synthetic.py --draft-bits`` times); both may be given (``0:h4:d4``).

Usage:
    python3 benchmarks/draft_vocab_tau.py --vocab 0,512,1024,2048,4096 --tokens 64
    python3 benchmarks/draft_vocab_tau.py --vocab 0,0:h4,0:d4,4096:h4:d4 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--vocab", default="0,512,1024,2048,4096", help="K[:hB][:dB] values (K 0: the whole)"
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4, help="the first N built-in prompts")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from slots_synthetic import quantized_drafter

    from hf2q.runtime.bench import BUILTIN_PROMPTS
    from hf2q.runtime.dflash import RoundDone, dflash_generate, plain_generate, run
    from hf2q.runtime.pair import apply_dtype, encode_prompt, load_pair

    pair = load_pair(None)
    apply_dtype(pair.target, pair.drafter, None)
    target = pair.target
    values = args.vocab.split(",")
    specs = {v: _spec(v) for v in values}
    drafters = {0: pair.drafter}
    for _, _, dbits in specs.values():
        if dbits not in drafters:
            drafters[dbits] = quantized_drafter(pair.drafter, dbits)
    tau: dict[str, list[float]] = {v: [] for v in values}
    equal = True
    for text in BUILTIN_PROMPTS[: args.prompts]:
        ids = encode_prompt(pair.tokenizer, text, chat=pair.chat_default)
        want = run(plain_generate(target, ids, max_tokens=args.tokens)).tokens
        for v in values:
            k, hbits, dbits = specs[v]
            drafter = drafters[dbits]
            drafter.bind(target.embed, target.draft_head(hbits, k))
            events = list(
                dflash_generate(target, drafter, ids, max_tokens=args.tokens, lookup=False)
            )
            rounds = [e for e in events if isinstance(e, RoundDone)]
            tau[v].append(round(statistics.mean(len(r.committed) for r in rounds), 3))
            equal &= events[-1].tokens == want
    report = {
        "model": f"{pair.target_source} + {pair.draft_source}",
        "vocab_size": target.vocab_size,
        "tokens": args.tokens,
        "rows": {
            v: len(target.draft_vocab_ids(k)) if k else target.vocab_size
            for v, (k, _, _) in specs.items()
        },
        "tau_per_prompt": tau,
        "tau_mean": {k: round(statistics.mean(v), 3) for k, v in tau.items()},
        "tokens_equal_plain": equal,
    }
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0 if equal else 1


def _spec(value: str) -> tuple[int, int, int]:
    """``K[:hB][:dB]`` -> (K, head bits, drafter bits); 0 bits: unquantized."""
    k, *rest = value.split(":")
    bits = {"h": 0, "d": 0}
    for part in rest:
        if part[:1] not in bits or part[1:] not in ("4", "8"):
            raise SystemExit(f"{value}: each part after K is h4, h8, d4 or d8")
        bits[part[0]] = int(part[1:])
    return int(k), bits["h"], bits["d"]


if __name__ == "__main__":
    raise SystemExit(main())
