"""A quantized target's compute dtype on this machine: half-precision scales or float32?

The embedded demo pair with its target quantized in place (MLX's affine quantization) decodes
the same prompt plainly and with DFlash, once with the scales, biases and other float weights
as loaded (bf16: activations in bf16) and once widened to float32 (``cast_models``, what
``--dtype auto`` does on a CPU since session 34; the packed weights stay), alternating in one
process after a warm-up. Reports generation tok/s (medians, min-max), whether each arm's
DFlash tokens equal its plain decoding's, and what ``--dtype auto`` picks here. ``--bits 0``:
the pair unquantized, as shipped (bf16 against float32: which one wins depends on the CPU BLAS,
see ``auto_dtype``).

    python benchmarks/quant_dtype.py --bits 4 --tokens 64 --runs 3 --out q.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rates(tps: dict[str, list[float]]) -> dict:
    """The report's tok/s entries: each arm's median and min-max, rounded to 0.1."""
    return {
        "tokens_per_s": {k: round(statistics.median(v), 1) for k, v in tps.items()},
        "tokens_per_s_min_max": {k: [round(min(v), 1), round(max(v), 1)] for k, v in tps.items()},
    }


def emit(report: dict, out: Path | None) -> None:
    """The report as one JSON line on stdout, and indented into ``out`` when given."""
    print(json.dumps(report))
    if out:
        out.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, default=4, help="0: the target unquantized")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per arm (after a warm-up)")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from quant_lossless import quantized_demo_pair

    from hf2q.platform import describe
    from hf2q.runtime.dflash import dflash_generate, plain_generate, run
    from hf2q.runtime.pair import auto_dtype

    pairs = {
        "bfloat16": quantized_demo_pair(args.bits, args.group),
        "float32": quantized_demo_pair(args.bits, args.group, "float32"),
    }
    prompt = pairs["float32"].tokenizer.encode(args.prompt)
    tps: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for r in range(args.runs + 1):  # run 0 warms up
        for arm, pair in pairs.items():
            for mode in ("plain", "dflash"):
                events = (
                    plain_generate(pair.target, prompt, max_tokens=args.tokens)
                    if mode == "plain"
                    else dflash_generate(pair.target, pair.drafter, prompt, max_tokens=args.tokens)
                )
                s = run(events)
                tokens.setdefault(f"{arm} {mode}", s.tokens)
                if r:
                    tps.setdefault(f"{arm} {mode}", []).append(s.generation_tps)
    auto = auto_dtype(pairs["bfloat16"].target, pairs["bfloat16"].drafter) or "bfloat16"
    report = {
        "model": (
            f"demo target, {args.bits}-bit groups of {args.group}" if args.bits else "demo target"
        ),
        "auto_dtype": auto,
        "tokens": args.tokens,
        "runs": args.runs,
        **rates(tps),
        "dflash_equals_plain": {
            arm: tokens[f"{arm} dflash"] == tokens[f"{arm} plain"] for arm in pairs
        },
        "platform": describe(),
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
