"""Where the host's time goes in hf2q's decoding loops (cProfile of a steady-state run).

Why: on a GPU a small model's decoding is bound by the host (building the graph, encoding
kernels, Python bookkeeping), so the profile of the host thread says what to cut. MLX's own
functions are not Python functions: their time (graph building, and in ``mx.eval`` /
``mx.async_eval`` the encoding of kernels and any wait for the device) counts in the *tottime*
of the Python function that calls them.

Usage (the embedded demo pair; a warm-up run first, then the profiled run):
    python benchmarks/host_profile.py --loops dflash,plain,slots-dflash,slots-plain --slots 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from slots_synthetic import add_pair_arguments, pair_and_prompts  # noqa: E402

from hf2q.runtime.dflash import dflash_generate, plain_generate, run  # noqa: E402
from hf2q.runtime.slots import (  # noqa: E402
    Request,
    run_slots,
    slots_dflash_generate,
    slots_plain_generate,
)

LOOPS = ("dflash", "plain", "slots-dflash", "slots-plain")


def _once(loop: str, pair, prompts: list[list[int]], slots: int, tokens: int, lookup: bool):
    events = loop_events(loop, pair, prompts, slots, tokens, lookup)
    return run(events) if loop in ("dflash", "plain") else run_slots(events)


def loop_events(loop: str, pair, prompts: list[list[int]], slots: int, tokens: int, lookup: bool):
    """The event generator of ``loop``: one sequence (``dflash``, ``plain``: the first prompt) or
    a batched loop (:func:`slots_events`)."""
    if loop == "dflash":
        return dflash_generate(
            pair.target, pair.drafter, prompts[0], max_tokens=tokens, lookup=lookup
        )
    if loop == "plain":
        return plain_generate(pair.target, prompts[0], max_tokens=tokens)
    return slots_events(loop, pair, prompts, slots, tokens, lookup)


def slots_events(loop: str, pair, prompts: list[list[int]], slots: int, tokens: int, lookup: bool):
    """The event generator of a batched loop (``slots-dflash`` or ``slots-plain``)."""
    reqs = [Request(p, max_tokens=tokens) for p in prompts]
    if loop == "slots-dflash":
        return slots_dflash_generate(pair.target, pair.drafter, reqs, slots=slots, lookup=lookup)
    return slots_plain_generate(pair.target, reqs, slots=slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(ap)
    ap.add_argument("--loops", default="dflash,plain")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--runners",
        action="store_true",
        help="run the compiled layer runners (CUDA's decoding path) on any device, to profile"
        " their host work on a CPU",
    )
    ap.add_argument(
        "--lookup",
        action="store_true",
        help="DFlash loops draft by n-gram lookup too (the CLI's default)",
    )
    ap.add_argument("--out", default=None, help="write a JSON summary here too")
    args = ap.parse_args()

    if args.runners:  # in this process only: the CUDA path's layer functions, here
        import hf2q.kernels.layers as layers
        import hf2q.runtime.verify as verify

        layers.decode_runners_active = verify.decode_runners_active = lambda: True
    pair, _, prompts = pair_and_prompts(args, args.slots)
    summary = {}
    for loop in args.loops.split(","):
        if loop not in LOOPS:
            raise SystemExit(f"unknown loop {loop!r}: choose from {', '.join(LOOPS)}")
        # Warm-up (kernel compilation).
        _once(loop, pair, prompts, args.slots, args.tokens, args.lookup)
        prof = cProfile.Profile()
        tic = time.perf_counter()
        prof.enable()
        s = _once(loop, pair, prompts, args.slots, args.tokens, args.lookup)
        prof.disable()
        wall = time.perf_counter() - tic
        steps = s.rounds or max(len(getattr(s, "round_times", []) or []), s.generation_tokens - 1)
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(args.top)
        print(
            f"== {loop}: {steps} steps, wall {wall:.3f} s (profiled), {wall / steps * 1e3:.3f} ms/step"
        )
        print("\n".join(buf.getvalue().splitlines()[6 : 8 + args.top]))
        rows = []
        for (file, line, fn), (_, ncalls, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
            rows.append((tt, ct, ncalls, f"{Path(file).name}:{line}({fn})"))
        rows.sort(reverse=True)
        summary[loop] = {
            "steps": steps,
            "wall_s": round(wall, 4),
            "top": [
                {
                    "fn": f,
                    "calls": n,
                    "tottime_ms_per_step": round(tt / steps * 1e3, 4),
                    "cumtime_ms_per_step": round(ct / steps * 1e3, 4),
                }
                for tt, ct, n, f in rows[: args.top]
            ],
        }
    text = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
