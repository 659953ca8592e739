"""Measure the demo pair's quality bars and write them as JSON.

What it measures (all on the machine it runs on, with the pair loaded exactly as ``hf2q
generate`` loads it, through ``hf2q.runtime.pair.load_pair``):

1. held-out perplexity of the target (MLX forward, non-overlapping windows of the held-out token
   stream ``heldout.npy``; also bits per byte);
2. tau at the drafter's block size, greedy, with the real DFlash loop
   (``hf2q.train.evaluate.measure_tau`` -> ``hf2q.runtime.dflash.dflash_generate``) on prompts
   that are prefixes of held-out files: the first ``--prompt-tokens`` tokens of every held-out
   file longer than that, in manifest order, up to ``--prompts``;
3. fidelity: greedy DFlash output equals plain greedy output on the first ``--fidelity``
   of those prompts (in bfloat16 exact ties can flip a token: reported as a count);
4. the default demo (the registry's ``[demo]`` prompt and settings, ``--demo-tokens`` tokens):
   share of distinct 4-grams in the generated tokens, the text, and the speed of plain decoding
   vs DFlash (generation tok/s, prefill excluded, median of ``--repeats`` alternating runs).

What it does not do: train or convert anything.

Usage::

    python scripts/demo/eval_pair.py --target hf2q/demo/target --draft hf2q/demo/draft \
        --data runs/demo/data --text runs/demo/text --out scripts/demo/logs/eval_pair.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def distinct_ngrams(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def heldout_ppl(target: Any, stream: Any, window: int, windows: int, batch: int) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    n = min(windows, (stream.size - 1) // window)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = np.stack(
            [stream[j * window : j * window + window + 1] for j in range(i, min(n, i + batch))]
        ).astype(np.int32)
        x = mx.array(rows)
        logits = target.model(x[:, :-1]).astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        picked = mx.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0]
        nll = (lse - picked).sum()
        mx.eval(nll)
        total += float(nll)
        count += int(x[:, 1:].size)
    loss = total / max(1, count)
    return {
        "windows": n,
        "window": window,
        "tokens_scored": count,
        "loss": loss,
        "perplexity": math.exp(loss),
    }


def heldout_tau_and_fidelity(args: Any, pair: Any) -> dict[str, Any]:
    """Tau on prefixes of held-out files (real DFlash loop) and greedy DFlash == plain on some."""
    from hf2q.runtime.dflash import plain_generate, run
    from hf2q.train.evaluate import measure_tau

    tok, target, drafter, eos = pair.tokenizer, pair.target, pair.drafter, pair.eos_token_ids
    result: dict[str, Any] = {}
    # Prompts: prefixes of held-out files, in manifest order.
    prompts, files = [], []
    for line in (args.text / "heldout.jsonl").read_text().splitlines():
        rec = json.loads(line)
        ids = list(tok.encode(rec["text"], add_special_tokens=False))
        if len(ids) > args.prompt_tokens:
            prompts.append(ids[: args.prompt_tokens])
            files.append(rec["path"])
        if len(prompts) >= args.prompts:
            break
    res = measure_tau(target, drafter, prompts, max_tokens=args.max_tokens, eos_token_ids=eos)
    result["tau"] = {
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "files": files,
        "tau": res.tau,
        "acceptance_rate": res.acceptance_rate,
        "rounds": res.rounds,
        "generated_tokens": res.generated_tokens,
        "per_prompt_tau_min": min(res.per_prompt_tau),
        "per_prompt_tau_median": statistics.median(res.per_prompt_tau),
        "per_prompt_tau_max": max(res.per_prompt_tau),
        "seconds": round(res.seconds, 1),
    }
    print(f"tau {res.tau:.3f} on {len(prompts)} held-out prompts", flush=True)

    same = 0
    for p, dflash_out in zip(prompts[: args.fidelity], res.outputs):
        plain = run(plain_generate(target, p, max_tokens=args.max_tokens, eos_token_ids=eos))
        same += plain.tokens == dflash_out
    result["fidelity"] = {"prompts": min(args.fidelity, len(prompts)), "identical": same}
    print(f"greedy DFlash == plain on {same}/{result['fidelity']['prompts']} prompts", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", type=Path, default=Path("runs/demo/data"))
    ap.add_argument("--text", type=Path, default=Path("runs/demo/text"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fidelity", type=int, default=16)
    ap.add_argument("--ppl-windows", type=int, default=96)
    ap.add_argument("--ppl-window", type=int, default=1024)
    ap.add_argument("--demo-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument(
        "--dtype", default="auto", help="as hf2q generate --dtype (auto: float32 on a CPU)"
    )
    ap.add_argument(
        "--demo-only", action="store_true", help="measure the default demo only (4. above)"
    )
    args = ap.parse_args(argv)

    from hf2q import platform as plat

    if hasattr(plat, "ensure_fast_blas"):
        plat.ensure_fast_blas(allow_reexec=True)  # the same BLAS choice as `hf2q generate`

    import numpy as np

    from hf2q.runtime.dflash import dflash_generate, plain_generate, run
    from hf2q.runtime.pair import apply_dtype, encode_prompt, load_pair, read_registry
    from hf2q.runtime.sampling import SamplingParams

    t0 = time.time()
    pair = load_pair(args.target, args.draft)
    tok, target, drafter = pair.tokenizer, pair.target, pair.drafter
    compute_dtype = apply_dtype(target, drafter, args.dtype)  # as `hf2q generate --dtype`
    eos = pair.eos_token_ids
    manifest = json.loads((args.data / "manifest.json").read_text())
    result: dict[str, Any] = {
        "target": args.target,
        "draft": args.draft,
        "environment": plat.describe(),
        "HF2Q_COMPILE": os.environ.get("HF2Q_COMPILE", "1 (default)"),
        "compute_dtype": compute_dtype,
        "block_size": drafter.block_size,
        "drafter": drafter.config.to_dict(),
    }

    if not args.skip_ppl and not args.demo_only:
        ppl = heldout_ppl(
            target, np.load(args.data / "heldout.npy"), args.ppl_window, args.ppl_windows, 8
        )
        split = manifest["splits"]["heldout"]
        ppl["bits_per_byte"] = ppl["loss"] / math.log(2) * split["tokens"] / split["bytes"]
        result["heldout_perplexity"] = ppl
        print(
            f"held-out perplexity {ppl['perplexity']:.3f} ({ppl['tokens_scored']} tokens)",
            flush=True,
        )

    if not args.demo_only:
        result.update(heldout_tau_and_fidelity(args, pair))

    demo = read_registry().get("demo") or {}
    text = demo.get("prompt", "")
    sampling = SamplingParams(
        temperature=float(demo.get("temp", 0.0)),
        top_p=float(demo.get("top_p", 1.0)),
        top_k=int(demo.get("top_k", 0)),
        seed=demo.get("seed"),
    )
    ids = encode_prompt(tok, text, chat=False)
    runs: dict[str, list[Any]] = {"plain": [], "dflash": []}
    for _ in range(args.repeats):
        runs["plain"].append(
            run(
                plain_generate(
                    target, ids, max_tokens=args.demo_tokens, sampling=sampling, eos_token_ids=eos
                )
            )
        )
        runs["dflash"].append(
            run(
                dflash_generate(
                    target,
                    drafter,
                    ids,
                    max_tokens=args.demo_tokens,
                    sampling=sampling,
                    eos_token_ids=eos,
                )
            )
        )
    d = runs["dflash"][0]
    plain_tps = statistics.median(s.generation_tps for s in runs["plain"])
    dflash_tps = statistics.median(s.generation_tps for s in runs["dflash"])
    result["demo"] = {
        "prompt": text,
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed,
        },
        "generated_tokens": d.generation_tokens,
        "finish_reason": d.finish_reason,
        "distinct_4grams": distinct_ngrams(d.tokens),
        "text": tok.decode(d.tokens),
        "tau": statistics.median(s.tau for s in runs["dflash"]),
        "plain_tok_s": [s.generation_tps for s in runs["plain"]],
        "dflash_tok_s": [s.generation_tps for s in runs["dflash"]],
        "speedup": dflash_tps / plain_tps if plain_tps else None,
        "same_tokens_as_plain": all(s.tokens == d.tokens for s in runs["plain"])
        if sampling.greedy
        else None,
    }
    print(
        f"demo: {d.generation_tokens} tokens, distinct 4-grams {result['demo']['distinct_4grams']:.3f}, "
        f"tau {result['demo']['tau']:.2f}, plain {plain_tps:.1f} tok/s, DFlash {dflash_tps:.1f} tok/s, "
        f"speedup {result['demo']['speedup']:.2f}x",
        flush=True,
    )
    result["wall_s"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
