"""Is greedy DFlash on a quantized target token-identical to plain decoding on this machine?

The embedded demo pair with its target quantized in place (MLX's affine quantization, bf16
activations), greedy: every prompt decoded plainly, then with DFlash at each block size, then
all prompts batched on N slots; each DFlash run's tokens compared with plain decoding's. The
same check as ``tests/test_kernels_qmatmul.py``'s CUDA test, for any backend (this CPU, an
NVIDIA GPU, an Apple GPU where it is not measured yet).

    python benchmarks/quant_lossless.py --bits 4,8 --out q.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]


def quantized_demo_pair(bits: int, group: int, dtype: str | None = None):
    """The embedded demo pair with its target quantized in place (``nn.quantize``; ``bits`` 0:
    left as shipped), its scales and other float weights cast to ``dtype`` where given, the
    drafter bound to the quantized target's embedding and head."""
    import mlx.core as mx
    import mlx.nn as nn

    from hf2q.runtime.pair import cast_models, load_pair

    pair = load_pair(None)
    if bits:
        nn.quantize(pair.target.model, group_size=group, bits=bits)
    if dtype is not None:
        cast_models(pair.target, pair.drafter, dtype)
    mx.eval(pair.target.model.parameters())
    pair.drafter.bind(pair.target.embed, pair.target.head)
    return pair


def check(bits: int, group: int, tokens: int, blocks: list[int], slots: int) -> dict:
    from hf2q.runtime.dflash import dflash_generate, plain_generate, run
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    pair = quantized_demo_pair(bits, group)
    prompts = [pair.tokenizer.encode(t) for t in PROMPTS]
    tic = time.perf_counter()
    want = [run(plain_generate(pair.target, p, max_tokens=tokens)).tokens for p in prompts]
    equal = {}
    for B in blocks:
        got = [
            run(dflash_generate(pair.target, pair.drafter, p, max_tokens=tokens, block_size=B))
            for p in prompts
        ]
        equal[f"block {B}"] = [s.tokens == w for s, w in zip(got, want)]
    reqs = [Request(p, max_tokens=tokens) for p in prompts]
    batched = run_slots(slots_dflash_generate(pair.target, pair.drafter, reqs, slots=slots))
    equal[f"{slots} slots"] = [s.tokens == w for s, w in zip(batched.requests, want)]
    return {
        "bits": bits,
        "group": group,
        "equal": equal,
        "all_equal": all(all(v) for v in equal.values()),
        "seconds": round(time.perf_counter() - tic, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--blocks", default="16,4")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import mlx.core as mx

    from hf2q.kernels import select

    blocks = [int(b) for b in args.blocks.split(",")]
    results = []
    for bits in (int(b) for b in args.bits.split(",")):
        r = check(bits, args.group, args.tokens, blocks, args.slots)
        results.append(r)
        print(json.dumps(r), flush=True)
    report = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "kernels": select.summary(),
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["all_equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
