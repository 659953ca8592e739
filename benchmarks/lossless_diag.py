"""Where do bf16 greedy DFlash and plain greedy decoding part? (prompt lengths x settings)

Session 17 on the H200 found ``plain_ab.py``'s DFlash tokens differing from plain decoding's on
the random Qwen3.5-4B-shaped pair with a 1024-token prompt, while ``hf2q bench`` (64-token
prompts) matched. For each prompt length and each setting (``NAME=V+NAME2=V2``, or ``default``)
this reports, as one JSON line each:

- ``prefill_logits_equal``/``first_cache_layer``: the prompt prefilled into DFlash's cache and
  into plain decoding's, the last logits compared bitwise and the first layer whose cache
  state differs (None: every layer equal);
- ``verify_vs_steps``: a 16-row verify block against 16 decode steps from those two states
  (``block_and_steps``): logits equal, and the first layer/row whose output differs;
- ``first_token_diff``: plain greedy tokens against DFlash's (and lagged DFlash's), the first
  index that differs (None: equal).

    python3 benchmarks/lossless_diag.py --synthetic 4b --prompt-tokens 64,1024 \
        --settings default,HF2Q_SDPA_BUCKET=0,HF2Q_PREFILL_RUNNERS=0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _states_equal(a, b) -> bool:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sa, sb = tree_flatten(a.state), tree_flatten(b.state)
    return len(sa) == len(sb) and all(
        (x is None and y is None) or (x is not None and y is not None and mx.array_equal(x, y))
        for (_, x), (_, y) in zip(sa, sb)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("small", "4b"), default=None)
    ap.add_argument("--prompt-tokens", default="64,1024")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens compared")
    ap.add_argument("--settings", default="default")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import mlx.core as mx

    from hf2q.runtime.cache import make_target_cache
    from hf2q.runtime.dflash import block_and_steps, dflash_generate, plain_generate, prefill, run

    if args.synthetic:
        from slots_synthetic import synthetic_pair

        pair = synthetic_pair(args.synthetic)
    else:
        from hf2q.runtime.pair import load_pair

        pair = load_pair(None)
    target, drafter = pair.target, pair.drafter
    vocab = target.args.vocab_size
    L, H = target.num_layers, target.hidden_size
    lines = []
    for setting in args.settings.split(","):
        env = {} if setting == "default" else dict(p.split("=", 1) for p in setting.split("+"))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for n in [int(x) for x in args.prompt_tokens.split(",")]:
                prompt = mx.random.randint(0, vocab, (n,), key=mx.random.key(n)).tolist()
                c1 = make_target_cache(target.model)
                l1, _ = prefill(target, prompt, c1)
                c2 = target.make_cache()
                l2, _ = prefill(target, prompt, c2)
                mx.eval(l1, l2, [c.state for c in c1], [c.state for c in c2])
                first_cache = next(
                    (i for i, (a, b) in enumerate(zip(c1, c2)) if not _states_equal(a, b)), None
                )
                plain = run(plain_generate(target, prompt, max_tokens=args.tokens)).tokens
                block = mx.array([plain[:16]])
                (lv, fv), (ld, fd) = block_and_steps(target, prompt, block, capture=list(range(L)))
                mx.eval(lv, fv, ld, fd)
                first_layer = first_row = None
                for li in range(L):
                    a, b = fv[..., li * H : (li + 1) * H], fd[..., li * H : (li + 1) * H]
                    if not mx.array_equal(a, b):
                        rows = mx.any(a != b, axis=-1)[0].tolist()
                        first_layer, first_row = li, rows.index(True)
                        break
                diffs = {}
                for lagged in ("0", "1"):
                    os.environ["HF2Q_LAGGED_ROUNDS"] = lagged
                    d = run(dflash_generate(target, drafter, prompt, max_tokens=args.tokens)).tokens
                    diffs[lagged] = next(
                        (i for i, (x, y) in enumerate(zip(plain, d)) if x != y),
                        None if len(plain) == len(d) else min(len(plain), len(d)),
                    )
                os.environ.pop("HF2Q_LAGGED_ROUNDS", None)
                line = {
                    "setting": setting,
                    "prompt_tokens": n,
                    "prefill_logits_equal": bool(mx.array_equal(l1, l2)),
                    "first_cache_layer": first_cache,
                    "verify_logits_equal": bool(mx.array_equal(lv, ld)),
                    "verify_first_layer": first_layer,
                    "verify_first_row": first_row,
                    "first_token_diff": diffs["0"],
                    "first_token_diff_lagged": diffs["1"],
                }
                print(json.dumps(line), flush=True)
                lines.append(line)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    if args.out:
        args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
