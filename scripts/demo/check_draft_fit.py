"""Tell a train/inference mismatch from overfitting: the training objective vs the real DFlash loop.

What it does: for a target + trained drafter and some sequences, (1) take the target's own greedy
continuation of each prompt (what greedy DFlash commits), (2) score the drafter on it with the
training forward (``hf2q.train.objective``: anchors at every generated position, target features
of the whole sequence), giving the leading-correct "train tau" and weighted accuracy, and (3) run
the real decoding loop (``hf2q.runtime.dflash.dflash_generate``, greedy) on the same prompt for
its tau. It also compares the trainer's block logits with the runtime drafter's (prefill + KV
cache) at two anchors of the first sequence. Sequences come from a training run's checkpoint
(``--dataset OUT/checkpoint/dataset.npz``: sequences the drafter was trained on) and/or from
held-out files (``--heldout heldout.jsonl``: first ``--prompt-tokens`` tokens as the prompt).

If objective and loop agree on both, and both are high on training sequences and low on held-out
ones, the drafter memorised its data (overfitting), not a mismatch.

What it does not do: train, or change anything.

Usage::

    python scripts/demo/check_draft_fit.py --target runs/demo/cpu/target --draft runs/demo/cpu/draft \
        --dataset runs/demo/cpu/draft/checkpoint/dataset.npz --heldout runs/demo/text/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dataset", type=Path, help="a train-draft checkpoint's dataset.npz")
    ap.add_argument("--heldout", type=Path, help="JSONL of held-out texts")
    ap.add_argument("--n", type=int, default=6, help="sequences of each kind")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    import mlx.core as mx
    import numpy as np

    from hf2q.runtime.dflash import dflash_generate, make_target_cache, plain_generate, prefill, run
    from hf2q.runtime.drafter import load_drafter
    from hf2q.runtime.pair import load_pair
    from hf2q.train import objective as ob

    pair = load_pair(args.target, args.draft)
    target, drafter, tok = pair.target, pair.drafter, pair.tokenizer
    d32 = load_drafter(args.draft, dtype=mx.float32).bind(target.embed, target.head)
    B, mask, ids = drafter.block_size, drafter.mask_token_id, drafter.config.target_layer_ids
    weights = mx.array(ob.loss_weights(B, ob.default_gamma(B)))

    def trainer_logits(seq: list[int], first: int) -> tuple[mx.array, ob.Blocks]:
        toks = np.array([seq], dtype=np.int32)
        anchors = np.arange(first, len(seq) - B + 1, dtype=np.int32)[None]
        lm = np.zeros_like(toks, dtype=bool)
        lm[:, first:] = True
        blocks = ob.make_blocks(
            toks, lm, np.array([len(seq)]), anchors, np.ones_like(anchors, bool), B, mask
        )
        feats = target.forward(mx.array(toks), capture=ids)[1].astype(mx.float32)
        emb = target.embed(mx.array(blocks.tokens.reshape(-1, B))).astype(mx.float32)
        h = ob.block_hidden(d32, emb, feats, mx.array(anchors))
        return target.head(h[:, 1:]).astype(mx.float32), blocks

    def score(seq: list[int], plen: int) -> dict[str, float]:
        logits, blocks = trainer_logits(seq, plen)
        A = blocks.anchors.shape[1]
        _, m = ob.decayed_loss(
            logits,
            mx.array(blocks.labels.reshape(A, B - 1)),
            mx.array(blocks.label_mask.reshape(A, B - 1)),
            weights,
        )
        real = run(dflash_generate(target, drafter, seq[:plen], max_tokens=len(seq) - plen))
        return {
            "objective_tau": 1 + m["leading"].item() / m["blocks"].item(),
            "objective_acc": m["correct"].item() / m["weight"].item(),
            "loop_tau": real.tau,
            "loop_equals_greedy": list(real.tokens) == seq[plen:],
        }

    kinds: dict[str, list[tuple[list[int], int]]] = {}
    if args.dataset:
        d = np.load(args.dataset)
        off = np.concatenate([[0], np.cumsum(d["lengths"])])
        picks = np.linspace(0, len(d["lengths"]) - 1, args.n).astype(int)
        kinds["training sequences"] = [
            (d["tokens"][off[i] : off[i + 1]].tolist(), int(d["prompt_lens"][i])) for i in picks
        ]
    if args.heldout:
        seqs = []
        for line in args.heldout.read_text().splitlines():
            ids_ = list(tok.encode(json.loads(line)["text"], add_special_tokens=False))
            if len(ids_) > args.prompt_tokens:
                p = ids_[: args.prompt_tokens]
                gen = run(plain_generate(target, p, max_tokens=args.max_tokens)).tokens
                seqs.append((p + list(gen), len(p)))
            if len(seqs) >= args.n:
                break
        kinds["held-out prompts"] = seqs

    report: dict[str, object] = {}
    for kind, seqs in kinds.items():
        rows = [score(s, p) for s, p in seqs]
        for r in rows:
            print(
                f"{kind}: objective tau {r['objective_tau']:.2f} acc {r['objective_acc']:.3f} | "
                f"real loop tau {r['loop_tau']:.2f}",
                flush=True,
            )
        summary = {k: statistics.mean(r[k] for r in rows) for k in ("objective_tau", "loop_tau")}
        summary["objective_acc"] = statistics.mean(r["objective_acc"] for r in rows)
        print(f"{kind}: mean {summary}", flush=True)
        report[kind] = {"rows": rows, "mean": summary}

    # One round, both code paths: the trainer's block logits vs the runtime drafter's.
    seq, plen = next(iter(kinds.values()))[0]
    logits, _ = trainer_logits(seq, plen)
    diffs = []
    for a in (plen, plen + 7):
        dcache = d32.make_cache()
        _, ctx = prefill(
            target, seq[:a], make_target_cache(target), drafter=d32, draft_cache=dcache
        )
        rt = d32(mx.array([[seq[a]] + [mask] * (B - 1)]), ctx.astype(mx.float32), dcache)[0]
        ref = logits[a - plen]
        diffs.append(
            {
                "anchor": a,
                "max_abs_diff": mx.abs(rt.astype(mx.float32) - ref).max().item(),
                "logit_scale": mx.abs(ref).max().item(),
                "argmax_equal": bool((rt.argmax(-1) == ref.argmax(-1)).all()),
            }
        )
        print(f"runtime vs trainer block logits: {diffs[-1]}", flush=True)
    report["runtime_vs_trainer"] = diffs
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
