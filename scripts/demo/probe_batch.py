"""Find the widest batch this machine's MLX backend runs for regeneration and feature capture.

Why: on the H200 (MLX 0.32.4, CUDA) ``hf2q train-draft --regenerate`` failed at ``--regen-batch``
256 and 1024 with ``cudaGraphAddKernelNode ... invalid argument`` (scripts/demo/logs/
h200_drafter_attempts/). Each candidate batch runs in a fresh process (a failed CUDA graph can
leave the process unusable): a batched prefill of 64-token prompts plus 8 decoding steps through
hf2q's own regeneration, and one feature-capture forward of ``batch`` x ``--seq-len`` tokens as
train-draft's feature cache does. The widest batch that passes is printed on stdout's last line;
each attempt's outcome goes to stderr.

Usage: python scripts/demo/probe_batch.py TARGET 512 256 128 64 [--seq-len 256]
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def attempt(target: str, batch: int, seq_len: int) -> None:
    import mlx.core as mx
    import numpy as np

    from hf2q.loading import load_model
    from hf2q.runtime.target import TargetModel
    from hf2q.train.data import TokenSeq, regenerate

    loaded = load_model(target)
    tgt = TargetModel(loaded.model, loaded.tokenizer)
    rng = np.random.default_rng(0)
    vocab = tgt.vocab_size
    seqs = [
        TokenSeq(rng.integers(1, vocab, 72).astype(np.int32), np.ones(72, bool), 0, False)
        for _ in range(batch)
    ]
    for _ in regenerate(tgt, seqs, seq_len=72, prompt_tokens=64, eos_ids=[], batch_size=batch):
        pass  # batch by batch, as train-draft drives it
    toks = mx.array(rng.integers(1, vocab, (batch, seq_len)).astype(np.int32))
    ids = [1, tgt.num_layers // 2, tgt.num_layers - 2]
    _, feats = tgt.forward(toks, capture=ids)
    mx.eval(feats)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("batches", nargs="*", type=int)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        attempt(a.target, a.one, a.seq_len)
        return 0
    best = 0
    for b in sorted(a.batches, reverse=True):
        r = subprocess.run(
            [sys.executable, __file__, a.target, "--one", str(b), "--seq-len", str(a.seq_len)],
            capture_output=True,
            text=True,
        )
        last = (r.stderr.strip().splitlines() or [""])[-1]
        print(f"batch {b}: {'ok' if r.returncode == 0 else 'FAILED: ' + last}", file=sys.stderr)
        if r.returncode == 0:
            best = b
            break
    print(best)
    return 0 if best else 1


if __name__ == "__main__":
    raise SystemExit(main())
