"""Per-step timing of plain and DFlash decoding in one process: JIT warm-up vs steady state.

Why: on MLX's CUDA backend the first calls of every new kernel shape compile (NVRTC), so a short
``hf2q generate`` run in a fresh process measures mostly compilation. This script decodes the same
prompt several times in one process and prints, per run, the step (plain) or round (DFlash) times
in windows (the first 8, then 9-64, then the rest), how many steps were slower than 5x the run's
median (compilations), and tok/s; the last run of each mode is the steady state. It also times
mlx-lm's own ``generate_step`` (stock plain decoding of the same model) for comparison.

Usage (the embedded demo pair; any pair with -m/-d):
    python benchmarks/step_trace.py --tokens 256 --repeats 3 --out trace.json
Environment knobs of hf2q apply (``HF2Q_COMPILE=0``, ``HF2Q_KERNELS=ops``).
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

import mlx.core as mx  # noqa: E402

from hf2q.kernels import select  # noqa: E402
from hf2q.runtime.dflash import (  # noqa: E402
    PrefillDone,
    RoundDone,
    StepDone,
    Summary,
    dflash_generate,
    plain_generate,
)
from hf2q.runtime.pair import apply_dtype, encode_prompt, load_pair  # noqa: E402

WINDOWS = ((0, 8), (8, 64), (64, None))


def _windows(times: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for lo, hi in WINDOWS:
        part = times[lo:hi]
        key = f"{lo + 1}-{hi if hi else 'end'}"
        out[key] = round(statistics.median(part) * 1e3, 3) if part else None
    return out


def _report(mode: str, run: int, times: list[float], tokens: int, decode_s: float, extra: dict):
    med = statistics.median(times) if times else 0.0
    slow = sum(1 for t in times if t > 5 * med)
    row = {
        "mode": mode,
        "run": run,
        "steps": len(times),
        "tokens": tokens,
        "decode_s": round(decode_s, 4),
        "tok_s": round(tokens / decode_s, 2) if decode_s > 0 else None,
        "median_ms": round(med * 1e3, 3),
        "window_median_ms": _windows(times),
        "slow_steps": slow,
        "slow_total_s": round(sum(t for t in times if t > 5 * med), 3),
        **extra,
    }
    print(json.dumps(row), flush=True)
    return row


def _hf2q_run(pair, ids, mode: str, tokens: int, block_size: int | None):
    if mode == "dflash":
        events = dflash_generate(
            pair.target,
            pair.drafter,
            ids,
            max_tokens=tokens,
            block_size=block_size,
            eos_token_ids=(),
        )
    else:
        events = plain_generate(pair.target, ids, max_tokens=tokens, eos_token_ids=())
    times, extra, out = [], {}, []
    for ev in events:
        if isinstance(ev, PrefillDone):
            extra["prefill_s"] = round(ev.prefill_time, 4)
            out.append(ev.token)
        elif isinstance(ev, RoundDone):
            times.append(ev.t_draft + ev.t_verify + ev.t_rollback)
            out.extend(ev.committed)
        elif isinstance(ev, StepDone):
            times.append(ev.t_step)
            out.append(ev.token)
        elif isinstance(ev, Summary):
            extra["decode_s_summary"] = round(ev.decode_time, 4)
            if ev.tau is not None:
                extra["tau"] = round(ev.tau, 3)
    return times, out, extra


def _stock_run(pair, ids, tokens: int):
    from mlx_lm.generate import generate_step

    times, out = [], []
    tic = time.perf_counter()
    prev = None
    for tok, _ in generate_step(mx.array(ids), pair.target.model, max_tokens=tokens):
        now = time.perf_counter()
        if prev is not None:
            times.append(now - prev)
        else:
            first = now - tic
        prev = now
        out.append(int(tok))
    return times, out, {"prefill_s": round(first, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-d", "--draft", default=None)
    ap.add_argument("--prompt", default=None, help="default: the demo pair's prompt")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--modes", default="stock,plain,dflash")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    pair = load_pair(args.model, args.draft, dflash="dflash" in args.modes)
    dtype = apply_dtype(pair.target, pair.drafter, args.dtype)
    text = args.prompt or pair.default_prompt or "def main():"
    ids = encode_prompt(pair.tokenizer, text, chat=False, thinking=False)
    attn = next(
        (layer.linear_attn for layer in pair.target.layers if getattr(layer, "is_linear", False)),
        None,
    )
    head = {
        "device": str(mx.default_device()),
        "dtype": dtype,
        "kernels": select.describe(attn),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("HF2Q_", "MLX_"))},
        "prompt_tokens": len(ids),
    }
    print(json.dumps(head), flush=True)
    rows, ref = [], None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for run in range(1, args.repeats + 1):
        for mode in modes:
            tic = time.perf_counter()
            if mode == "stock":
                times, out, extra = _stock_run(pair, ids, args.tokens)
            else:
                times, out, extra = _hf2q_run(pair, ids, mode, args.tokens, args.block_size)
            wall = time.perf_counter() - tic
            ref = ref or out
            extra["equal_first_run"] = out[: len(ref)] == ref[: len(out)]
            extra["wall_s"] = round(wall, 3)
            rows.append(_report(mode, run, times, len(out) - 1, sum(times), extra))
    if args.out:
        Path(args.out).write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
