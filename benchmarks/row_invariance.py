"""Where do a verify block's rows and plain decoding's steps part? (per decoder layer)

DFlash is lossless when the verify computes each row exactly as plain decoding computes that
step. In float32 they agree to rounding and the greedy tokens are equal (tests); in bf16 a single
rounding difference can flip a near-tie. This script runs the target over the same T tokens
twice from the same prefilled state: once as one verify block (``verify_forward`` on the DFlash
cache, as a round does) and once one token at a time (plain decoding's step and cache), capturing
every decoder layer's output, and reports per layer the largest difference between verify row i
and decode step i, the first layer where any row differs (and its kind), and whether the greedy
tokens agree. Bit-equal rows in every layer mean the two paths compute identically.

    python benchmarks/row_invariance.py --tokens 16 --out runs/row_invariance.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="target (default: the embedded demo pair)")
    ap.add_argument("--prompt", default=None, help="default: the demo pair's prompt")
    ap.add_argument("--tokens", type=int, default=16, help="block length T")
    ap.add_argument("--dtype", default="native", help="native (the files' dtype) or a cast")
    ap.add_argument("--out")
    args = ap.parse_args()

    from hf2q.kernels import select
    from hf2q.runtime.dflash import block_and_steps, plain_generate, run
    from hf2q.runtime.pair import apply_dtype, encode_prompt, load_pair

    pair = load_pair(args.model, dflash=False)
    target = pair.target
    dtype = apply_dtype(target, None, args.dtype)
    text = args.prompt or pair.default_prompt or "def fibonacci(n):"
    prompt = encode_prompt(pair.tokenizer, text, chat=pair.chat_default)
    T = args.tokens
    # The tokens both paths consume: plain greedy decoding's first T tokens.
    block = mx.array([run(plain_generate(target, prompt, max_tokens=T)).tokens[:T]])
    L, H = target.num_layers, target.hidden_size
    capture = list(range(L))

    (logits_v, feats_v), (logits_d, feats_d) = block_and_steps(
        target, prompt, block, capture=capture
    )
    mx.eval(logits_v, feats_v, logits_d, feats_d)

    layers = []
    first = None
    for li in range(L):
        a = feats_v[..., li * H : (li + 1) * H].astype(mx.float32)
        b = feats_d[..., li * H : (li + 1) * H].astype(mx.float32)
        per_row = mx.abs(a - b).max(axis=(0, 2))
        rows_differing = int((per_row > 0).sum().item())
        kind = "Gated-DeltaNet" if target.is_linear(li) else "attention"
        layers.append(
            {
                "layer": li,
                "kind": kind,
                "max_abs_diff": per_row.max().item(),
                "rows_differing": rows_differing,
            }
        )
        if first is None and rows_differing:
            first = layers[-1]
    agree = (logits_v.argmax(-1) == logits_d.argmax(-1))[0]
    report = {
        "backend": select.backend(),
        "dtype": dtype,
        "kernels": select.summary(target),
        "tokens": T,
        "first_layer_differing": first,
        "logits_max_abs_diff": mx.abs(logits_v.astype(mx.float32) - logits_d.astype(mx.float32))
        .max()
        .item(),
        "greedy_agree_rows": int(agree.sum().item()),
        "layers": layers,
    }
    print(f"{report['backend']} {dtype}; {report['kernels']}")
    for r in layers:
        print(
            f"layer {r['layer']:2d} {r['kind']:15s} max |verify - decode| {r['max_abs_diff']:.3g}"
            f" ({r['rows_differing']} of {T} rows differ)"
        )
    print(
        f"logits max diff {report['logits_max_abs_diff']:.3g}; greedy tokens agree on "
        f"{report['greedy_agree_rows']} of {T} rows; first layer differing: {first}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
