"""Plain decoding's time per token (and a DFlash round's) with a switch off and on, alternating
in one process.

Why: on the lent GPU machines the same code's step time varied 4.8-7.3 ms between processes
(docs/BENCHMARKS.md, "H200, session 15"), so a switch is judged here by alternating its values
within one process, run after run, and comparing medians. Default: ``HF2Q_COMPILE_FORWARD`` (a
whole decode step as one compiled graph) on the random Qwen3.5-4B-shaped target; each value's
first run's tokens are checked against the first value's (``tokens_equal``: the same numerics),
and every run of every mode against that value's first (``tokens_within_value``: lossless
under that setting). A value with ``=`` is a whole setting,
``NAME=V+NAME2=V2`` (names of other values' settings are unset for it). ``--modes plain,dflash``
also times DFlash with the random drafter (about one token a round): its round time and
E = plain step / round per value, both from the same alternation.

Usage (GPU):
    python3 benchmarks/plain_ab.py --synthetic 4b --tokens 128 --runs 5
    python3 benchmarks/plain_ab.py --env HF2Q_SMALL_MM --values 1,0
    python3 benchmarks/plain_ab.py --values HF2Q_GROUPED_MM=0,HF2Q_GROUPED_MM=1 --modes plain,dflash
    python3 benchmarks/plain_ab.py --demo --lookup --values HF2Q_LAGGED_LOOKUP=0,HF2Q_LAGGED_LOOKUP=1 \
        --modes plain,dflash
    python3 benchmarks/plain_ab.py --values HF2Q_DRAFT_HEAD_BITS=0,HF2Q_DRAFT_HEAD_BITS=8 \
        --modes plain,dflash --tokens 32 --prompt-tokens 64   (drafts from a quantized head)
    python3 benchmarks/plain_ab.py --values HF2Q_DRAFT_VOCAB=0,HF2Q_DRAFT_VOCAB=32768 \
        --modes plain,dflash --tokens 32 --prompt-tokens 64   (drafts from 32768 of the ids)
    python3 benchmarks/plain_ab.py --values AB_DRAFT_BITS=0,AB_DRAFT_BITS=4 \
        --modes plain,dflash --tokens 32 --prompt-tokens 64   (a 4-bit copy of the drafter)

``--slots N`` decodes N random prompts together (batched plain decoding and batched DFlash,
``hf2q.runtime.slots``) and reports per value the round time and the aggregate tok/s:
    python3 benchmarks/plain_ab.py --slots 4 --values HF2Q_DRAFT_MM_ROWS=128,HF2Q_DRAFT_MM_ROWS=32 \
        --modes plain,dflash --tokens 32 --prompt-tokens 64

``--demo`` runs the embedded demo pair on its fibonacci prompt (the built-in workload's first,
where lookup drafts loops) instead of a random pair and prompt; ``--lookup`` lets DFlash draft
by lookup as ``hf2q generate --dflash`` does by default.
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


#: A value naming either binds the drafter to ``TargetModel.draft_head(bits, vocab)`` for its runs.
DRAFT_HEAD_ENV = "HF2Q_DRAFT_HEAD_BITS"
DRAFT_VOCAB_ENV = "HF2Q_DRAFT_VOCAB"
#: plain_ab.py's own name (hf2q reads no such setting): a value with ``AB_DRAFT_BITS=4`` (or 8) runs
#: a copy of the drafter with its layers quantized as ``slots_synthetic.py --draft-bits`` does
#: (the same weights), so a quantized drafter alternates with the unquantized one in one process.
DRAFT_BITS_ENV = "AB_DRAFT_BITS"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("small", "4b"), default="4b")
    ap.add_argument("--target-bits", type=int, default=0, choices=[0, 4, 8])
    ap.add_argument("--demo", action="store_true", help="the embedded demo pair and its prompt")
    ap.add_argument("--lookup", action="store_true", help="DFlash may draft by lookup")
    ap.add_argument("--env", default="HF2Q_COMPILE_FORWARD")
    ap.add_argument("--values", default="0,1")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per value (after a warm-up)")
    ap.add_argument("--modes", default="plain", help="plain, or plain,dflash")
    ap.add_argument("--slots", type=int, default=0, help="N > 0: N prompts decoded together")
    ap.add_argument(
        "--runners", action="store_true", help="the compiled runners as the path here (CPU)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import mlx.core as mx
    from host_profile import _once
    from slots_synthetic import quantized_drafter, synthetic_pair

    import hf2q.kernels.layers as layers

    if args.runners:  # in this process only (verify reads the name it imported)
        import hf2q.runtime.verify as verify

        layers.decode_runners_active = verify.decode_runners_active = lambda: True
    if args.demo:
        from hf2q.runtime.bench import BUILTIN_PROMPTS
        from hf2q.runtime.pair import encode_prompt, load_pair

        pair = load_pair(None)
        prompt = encode_prompt(pair.tokenizer, BUILTIN_PROMPTS[0], chat=False)
    else:
        pair = synthetic_pair(args.synthetic, target_bits=args.target_bits)
        prompt = _random_prompt(pair, args.prompt_tokens, 1)
    prompts = [prompt]
    if args.slots > 0:  # the prompt above, then random ones of its length
        prompts += [_random_prompt(pair, len(prompt), 2 + i) for i in range(args.slots - 1)]
    values = args.values.split(",")
    settings = {v: _setting(args.env, v) for v in values}
    names = sorted({n for st in settings.values() for n in st})
    drafters = {0: pair.drafter}
    for st in settings.values():
        bits = int(st.get(DRAFT_BITS_ENV, "0"))
        if bits not in drafters:
            drafters[bits] = quantized_drafter(pair.drafter, bits)
    modes = args.modes.split(",")
    ms: dict[str, dict[str, list[float]]] = {m: {v: [] for v in values} for m in modes}
    every: dict[str, dict[str, list[list[int]]]] = {m: {} for m in modes}  # every run's tokens
    per_token: dict[str, list[float]] = {v: [] for v in values}
    tps: dict[str, dict[str, list[float]]] = {m: {v: [] for v in values} for m in modes}
    for r in range(args.runs + 1):  # run 0 compiles
        for v in values:
            for n in names:
                os.environ.pop(n, None)
            os.environ.update(settings[v])
            pair.drafter = drafters[int(settings[v].get(DRAFT_BITS_ENV, "0"))]
            if {DRAFT_HEAD_ENV, DRAFT_VOCAB_ENV} & set(names):  # as hf2q generate / bench do
                bits = int(os.environ.get(DRAFT_HEAD_ENV, "0"))
                vocab = int(os.environ.get(DRAFT_VOCAB_ENV, "0"))
                pair.drafter.bind(pair.target.embed, pair.target.draft_head(bits, vocab))
            for mode in modes:
                loop = f"slots-{mode}" if args.slots else mode
                s = _once(loop, pair, prompts, args.slots, args.tokens, args.lookup)
                if loop == "plain":
                    per = max(s.generation_tokens - 1, 1)
                else:
                    per = max(s.rounds, 1)
                if r:
                    ms[mode][v].append(s.decode_time / per * 1e3)
                    tps[mode][v].append(s.generation_tps)
                    # With lookup the rounds differ: DFlash's time per token too.
                    if mode == "dflash" and not args.slots:
                        per_token[v].append(s.decode_time / max(s.generation_tokens - 1, 1) * 1e3)
                got = [t for q in s.requests for t in q.tokens] if args.slots else s.tokens
                every[mode].setdefault(v, []).append(got)
    first = {m: {v: every[m][v][0] for v in values} for m in modes}  # each value's first run
    report = {
        "model": "demo pair"
        if args.demo
        else f"synthetic {args.synthetic}"
        + (f" ({args.target_bits}-bit target)" if args.target_bits else ""),
        "lookup": args.lookup,
        "device": str(mx.default_device()),
        "env": args.env,
        "values": {v: settings[v] for v in values},
        "tokens": args.tokens,
        "runs": args.runs,
        "slots": args.slots or None,
        "ms_per_token": {v: round(statistics.median(x), 4) for v, x in ms[modes[0]].items()},
        "ms_per_token_min_max": {
            v: [round(min(x), 4), round(max(x), 4)] for v, x in ms[modes[0]].items()
        },
        "same_tokens": all(
            first[m][v] == first[modes[0]][values[0]] for m in modes for v in values
        ),
        "tokens_equal": {
            f"{m} {v}": first[m][v] == first[modes[0]][values[0]] for m in modes for v in values
        },
        # Per value, every run of every mode the same tokens as its first plain (or first) run:
        # lossless decoding under that setting, whatever another setting's numerics give.
        "tokens_within_value": {
            v: all(t == first[modes[0]][v] for m in modes for t in every[m][v]) for v in values
        },
        "tokens_per_s": {
            f"{m} {v}": round(statistics.median(tps[m][v]), 2) for m in modes for v in values
        },
    }
    if "dflash" in modes:
        rounds = {v: statistics.median(x) for v, x in ms["dflash"].items()}
        report["dflash_round_ms"] = {v: round(x, 4) for v, x in rounds.items()}
        if not args.slots:
            report["dflash_ms_per_token"] = {
                v: round(statistics.median(x), 4) for v, x in per_token.items()
            }
        if "plain" in modes:
            report["E"] = {
                v: round(statistics.median(ms["plain"][v]) / rounds[v], 3) for v in values
            }
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report) + "\n")
    return 0


def _random_prompt(pair, n: int, seed: int) -> list[int]:
    """``n`` token ids drawn uniformly from the target's vocabulary with key ``seed``."""
    import mlx.core as mx

    vocab = pair.target.args.vocab_size
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()


def _setting(env: str, value: str) -> dict[str, str]:
    """``value`` as environment settings: ``{env: value}``, or ``NAME=V+NAME2=V2`` as given."""
    if "=" not in value:
        return {env: value}
    return dict(part.split("=", 1) for part in value.split("+"))


if __name__ == "__main__":
    raise SystemExit(main())
