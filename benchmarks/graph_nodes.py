"""How many graph nodes each evaluation of a decoding loop runs, by call site and by operation.

Why: on a GPU a small model's step or DFlash round is bound by the host and by kernel launches,
not by arithmetic, so its time follows the number of primitives MLX evaluates per step. This
script decodes with hf2q's loops (single sequence: ``hf2q.runtime.dflash``; N slots:
``hf2q.runtime.slots``) and, at every ``mx.eval`` / ``mx.async_eval`` those loops call, writes the
pending graph with ``mx.export_to_dot`` and counts its nodes (and which primitives they are).
MLX picks fused or fallback implementations when a graph is built, for the device it is built
on, so run it on the machine you care about: CPU counts include fallbacks (``rms_norm``,
``rope`` as several ops) that a GPU runs as one kernel.

How: the loops' module-level ``mx`` is replaced, in this process only, by a forwarding object
whose ``eval`` / ``async_eval`` count before evaluating; nothing else changes, so the tokens are
the loops' own. The first run warms up and is not reported.

Usage (the embedded demo pair):
    python benchmarks/graph_nodes.py --slots 8 --gen-tokens 32 --out nodes.json
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from slots_synthetic import add_pair_arguments, pair_and_prompts  # noqa: E402

import hf2q.runtime.dflash as single  # noqa: E402
import hf2q.runtime.slots as batched  # noqa: E402

_NODE = re.compile(r'label ="([^"]+)", shape=rectangle')


class _Counter:
    """Stands in for ``mlx.core`` in the loops' modules; counts what each evaluation runs."""

    def __init__(self) -> None:
        fd, self._dot = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
        self.on = False
        self.timing = False  # time each evaluation instead of counting its nodes
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.nodes: collections.Counter[str] = collections.Counter()
        self.ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    @staticmethod
    def _site() -> str:
        frame = traceback.extract_stack(limit=4)[0]
        line = linecache.getline(frame.filename, frame.lineno).strip()
        return f"{Path(frame.filename).name}:{frame.lineno} {line}"

    def _count(self, args: tuple[Any, ...]) -> None:
        if not self.on or self.timing:
            return
        site = self._site()
        arrays: list[mx.array] = []

        def walk(a: Any) -> None:
            if isinstance(a, mx.array):
                arrays.append(a)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    walk(x)
            elif isinstance(a, dict):
                for x in a.values():
                    walk(x)

        walk(args)
        self.calls[site] += 1
        if arrays:
            mx.export_to_dot(self._dot, *arrays)
            labels = _NODE.findall(Path(self._dot).read_text())
            self.nodes[site] += len(labels)
            self.ops[site].update(labels)

    def _timed(self, fn: Any, args: tuple[Any, ...]) -> None:
        if not (self.on and self.timing):
            fn(*args)
            return
        site = self._site()
        tic = time.perf_counter()
        fn(*args)
        self.seconds[site] += time.perf_counter() - tic
        self.calls[site] += 1

    def eval(self, *args: Any) -> None:
        self._count(args)
        self._timed(mx.eval, args)

    def async_eval(self, *args: Any) -> None:
        self._count(args)
        self._timed(mx.async_eval, args)


def _run(
    mode: str, pair: Any, prompts: list[list[int]], slots: int, tokens: int, lookup: bool = False
) -> Any:
    if mode in ("dflash", "plain") and slots == 0:
        if mode == "dflash":
            gen = single.dflash_generate(
                pair.target, pair.drafter, prompts[0], max_tokens=tokens, lookup=lookup
            )
        else:
            gen = single.plain_generate(pair.target, prompts[0], max_tokens=tokens)
        return list(gen)[-1]
    reqs = [batched.Request(p, max_tokens=tokens) for p in prompts]
    gen = (
        batched.slots_dflash_generate(pair.target, pair.drafter, reqs, slots=slots, lookup=lookup)
        if mode == "dflash"
        else batched.slots_plain_generate(pair.target, reqs, slots=slots)
    )
    return batched.run_slots(gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(ap)
    ap.add_argument("--slots", type=int, default=8, help="N slots; 0 = the single-sequence loops")
    ap.add_argument("--modes", default="plain,dflash")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=12, help="operations listed per call site")
    ap.add_argument(
        "--lookup",
        action="store_true",
        help="DFlash loops draft by n-gram lookup too (the CLI's default): batched rounds then "
        "run synchronously whenever a proposal is due",
    )
    ap.add_argument(
        "--time",
        action="store_true",
        help="also run once more timing each evaluation call (eval: encoding + waiting for the "
        "device; async_eval: encoding only), without counting",
    )
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()

    pair, dtype, prompts = pair_and_prompts(args, max(args.slots, 1))
    counter = _Counter()
    single.mx = batched.mx = counter  # type: ignore[assignment]
    report: dict[str, Any] = {
        "device": str(mx.default_device()),
        "dtype": dtype,
        "slots": args.slots,
        "gen_tokens": args.gen_tokens,
        "lookup": args.lookup,
        "modes": {},
    }
    for mode in args.modes.split(","):
        _run(mode, pair, prompts, args.slots, args.gen_tokens, args.lookup)  # warm-up
        counter.calls.clear(), counter.nodes.clear(), counter.ops.clear()
        counter.on = True
        tic = time.perf_counter()
        s = _run(mode, pair, prompts, args.slots, args.gen_tokens, args.lookup)
        wall = time.perf_counter() - tic
        counter.on = False
        rounds = max(int(s.rounds or 0), 1) if mode == "dflash" else None
        sites = []
        for site, n in counter.calls.most_common():
            sites.append(
                {
                    "site": site,
                    "calls": n,
                    "nodes_per_call": round(counter.nodes[site] / n, 1),
                    "top_ops": counter.ops[site].most_common(args.top),
                }
            )
        steps = rounds or max(len(getattr(s, "round_times", []) or []), 1)
        if mode == "plain" and args.slots == 0:
            steps = max(s.generation_tokens - 1, 1)
        # Sites the loop calls about once a step; the rest (prefill, first tokens) are per request.
        total = sum(counter.nodes[k] for k, n in counter.calls.items() if n >= steps / 2)
        report["modes"][mode] = {
            "steps": steps,
            "nodes_per_step": round(total / steps, 1),
            "wall_s_with_counting": round(wall, 3),
            "sites": sites,
        }
        print(f"{mode}: {steps} steps, {total / steps:.0f} nodes per step (loop sites)", flush=True)
        for x in sites:
            print(f"  {x['calls']:4d} x {x['nodes_per_call']:7.1f}  {x['site'][:90]}")
            print("        " + ", ".join(f"{k} {v}" for k, v in x["top_ops"]))
        if args.time:
            counter.calls.clear(), counter.seconds.clear()
            counter.on = counter.timing = True
            tic = time.perf_counter()
            _run(mode, pair, prompts, args.slots, args.gen_tokens, args.lookup)
            wall = time.perf_counter() - tic
            counter.on = counter.timing = False
            timed = [
                {"site": k, "calls": n, "ms_per_call": round(counter.seconds[k] / n * 1e3, 4)}
                for k, n in counter.calls.most_common()
            ]
            report["modes"][mode]["timed_wall_s"] = round(wall, 4)
            report["modes"][mode]["eval_ms"] = timed
            print(f"  timed run: {wall / steps * 1e3:.3f} ms per step (wall incl. prefill)")
            for x in timed:
                print(f"  {x['calls']:4d} x {x['ms_per_call']:8.4f} ms  {x['site'][:90]}")
    text = json.dumps(report)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
