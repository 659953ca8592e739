"""``hf2q bench``'s batched runs with a setting's values alternating in one process.

Why: the lent GPU hosts' speed moves between processes (docs/BENCHMARKS.md), so two ``hf2q
bench`` calls one after the other do not decide a switch; this runs the bench's own workload
(the embedded demo pair, the built-in prompts, ``--requests-per-slot`` requests a slot, EOS
honoured) through the bench's own run function (``hf2q.runtime.bench._run_slots_mode``),
plain batched decoding once per run and batched DFlash once per value, value after value, run
after run, and reports medians: tok/s, round ms, tau, busy rows, the lookup share, DFlash over
plain, and whether every value's tokens equal plain decoding's.

Usage:
    python3 benchmarks/bench_ab.py --slots 1,8 --values HF2Q_LAGGED_LOOKUP=0,HF2Q_LAGGED_LOOKUP=device
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--env", default="HF2Q_LAGGED_LOOKUP", help="the setting of bare values")
    ap.add_argument(
        "--values", default="0,device", help="VALUE or NAME=V[+NAME2=V2], comma-separated"
    )
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per value (after a warm-up)")
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import mlx.core as mx
    from plain_ab import _setting

    from hf2q.runtime.bench import BenchConfig, _run_slots_mode, make_prompts, parse_slots
    from hf2q.runtime.pair import load_pair

    pair = load_pair(None, None)
    t, d = pair.target, pair.drafter
    config = BenchConfig(
        slots=parse_slots(args.slots),
        gen_tokens=args.gen_tokens,
        requests_per_slot=args.requests_per_slot,
        lookup=not args.no_lookup,
    ).validate()
    eos = frozenset(int(e) for e in pair.eos_token_ids)
    avoid = sorted(set(pair.eos_token_ids) | {d.mask_token_id})
    values = args.values.split(",")
    settings = {v: _setting(args.env, v) for v in values}
    names = sorted({n for st in settings.values() for n in st})
    report: dict = {"values": settings, "runs": args.runs, "config": vars(args) | {"out": None}}
    rows = []
    start = time.perf_counter()
    for N in config.slots:
        prompts = make_prompts(
            config,
            N * config.requests_per_slot,
            tokenizer=pair.tokenizer,
            vocab_size=t.vocab_size,
            avoid=avoid,
        )
        res: dict[str, list] = {"plain": [], **{v: [] for v in values}}
        for r in range(args.runs + 1):  # run 0 warms up (compiles)
            for key in ["plain", *values]:
                for n in names:
                    os.environ.pop(n, None)
                if key != "plain":
                    os.environ.update(settings[key])
                mx.clear_cache()
                got = _run_slots_mode(
                    "plain" if key == "plain" else "dflash", t, d, prompts, config, eos, N
                )
                if r:
                    res[key].append(got)
                print(f"[{time.perf_counter() - start:7.1f}s] {N} slots {key} run {r}", flush=True)
        plain = res["plain"]
        want = plain[0].tokens
        p_tps = statistics.median(x.tokens_per_s for x in plain)
        for key, got in res.items():
            tps = statistics.median(x.tokens_per_s for x in got)
            rows.append(
                {
                    "slots": N,
                    "value": key,
                    "tokens_per_s": round(tps, 2),
                    "tokens_per_s_min_max": [
                        round(min(x.tokens_per_s for x in got), 2),
                        round(max(x.tokens_per_s for x in got), 2),
                    ],
                    "round_ms": round(statistics.median(x.round_s for x in got) * 1e3, 4),
                    "tau": got[0].tau,
                    "busy_rows": round(statistics.median(x.busy_rows for x in got), 3),
                    "lookup_share": got[0].lookup_share,
                    "x_plain": round(tps / p_tps, 3),
                    "tokens_equal_plain": all(x.tokens == want for x in got),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    report["results"] = rows
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["device"] = str(mx.default_device())
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
