"""Which compute dtype is faster for `hf2q generate` on this machine: each dtype and mode as a
user runs it, one process per run, alternating.

Runs ``python -m hf2q generate --json -n TOKENS --dtype D (--dflash | --no-dflash) [PROMPT]``
on the embedded demo pair (or ``--model`` / ``--draft``) for each of ``--dtypes``, in turn,
``--runs`` times after one warm-up round, and reports the generation tok/s (prefill excluded;
medians and min-max), tau, the BLAS the runs used, and whether every run of a dtype gave the
same tokens in both modes. Separate processes: one process holding models of two dtypes ran
both slower (``quant_dtype.py --bits 0``: plain decoding 36 tok/s where a lone process ran 55-65,
session 53). The environment is passed on, so ``LD_PRELOAD`` / ``HF2Q_BLAS`` choose the BLAS.

    python benchmarks/dtype_ab.py --dtypes bfloat16,float32 --tokens 128 --runs 3 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_dtype import emit, rates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def generate_json(
    options: list[str], tokens: int, model: str | None, draft: str | None, prompt: str | None
) -> dict:
    """One ``python -m hf2q generate --json`` process's record (its last stdout line), with
    ``options``, on ``model`` / ``draft`` (None: the demo pair; the drafter only with DFlash)."""
    cmd = [sys.executable, "-m", "hf2q", "generate", "--json", "-n", str(tokens), *options]
    cmd += ["-m", model] if model else []
    cmd += ["-d", draft] if draft and "--no-dflash" not in options else []
    cmd += [prompt] if prompt is not None else []
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def generate(args: argparse.Namespace, dtype: str, mode: str) -> dict:
    options = ["--dtype", dtype, f"--{mode}"]
    return generate_json(options, args.tokens, args.model, args.draft, args.prompt or None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--modes", default="dflash,no-dflash")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="timed rounds (after one warm-up)")
    ap.add_argument("--prompt", default=None, help="default: the pair's own default prompt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    arms = [(d, m) for d in args.dtypes.split(",") for m in args.modes.split(",")]
    tps: dict[str, list[float]] = {}
    last: dict[str, dict] = {}
    tokens: dict[str, set] = {}
    for r in range(args.runs + 1):  # round 0 warms up
        for dtype, mode in arms:
            key = f"{dtype} {mode}"
            rec = generate(args, dtype, mode)
            last[key] = rec
            tokens.setdefault(dtype, set()).add(tuple(rec["tokens"]))
            if r:
                tps.setdefault(key, []).append(rec["generation_tps"])
    report = {
        "command": f"python -m hf2q generate --json -n {args.tokens} --dtype D --MODE",
        "tokens": args.tokens,
        "runs": args.runs,
        **rates(tps),
        "tau": {k: v.get("tau") for k, v in last.items() if v.get("tau") is not None},
        "dtype_reported": {k: v.get("dtype") for k, v in last.items()},
        "blas": {k: v.get("blas") for k, v in last.items()},
        "same_tokens_every_run_and_mode": {d: len(t) == 1 for d, t in tokens.items()},
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
