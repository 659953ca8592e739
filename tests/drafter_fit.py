"""A small, honest drafter fit for tests: make a tiny DFlash drafter agree with its tiny target.

Random drafters reject almost every draft, so fidelity tests on them would only ever exercise
rejections. This fits a drafter to the target's own greedy continuations of a few prompts with
the DFlash objective (``shared/docs/dflash.md``: block ``[x_p, MASK x (B-1)]`` at an anchor p,
context = target features of positions before p, block position k predicts x_{p+k}, loss
weights exp(-(k-1)/gamma)), using the drafter's own forward. It memorises those continuations, which
is what the tests need: long acceptances and full-block accepts on the same prompts.

It is not the product trainer (``hf2q train-draft``, issue 4) and makes no claim of generalising.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from hf2q.runtime.dflash import plain_generate, run
from hf2q.runtime.drafter import DFlashDraftModel
from hf2q.runtime.target import TargetModel


def greedy_sequences(target: TargetModel, prompts: Sequence[Sequence[int]], n_new: int) -> mx.array:
    """Prompt + ``n_new`` greedy tokens of the target for each prompt (no EOS stop), (N, L)."""
    rows = []
    for p in prompts:
        toks = run(plain_generate(target, list(p), max_tokens=n_new)).tokens
        rows.append(list(p) + toks)
    return mx.array(rows, dtype=mx.int32)


def fit_drafter(
    target: TargetModel,
    drafter: DFlashDraftModel,
    sequences: mx.array,
    *,
    steps: int = 300,
    anchors_per_step: int = 1,
    lr: float = 3e-3,
    gamma: float = 7.0,
    seed: int = 0,
) -> list[float]:
    """Fit ``drafter`` (bound to ``target``) to ``sequences`` (N, L) of equal length; return losses.

    Every step takes ``anchors_per_step`` anchor positions p, each for all N sequences at once
    (a shared position keeps the drafter's own cached forward usable for a batch).
    """
    B = drafter.block_size
    ids = drafter.config.target_layer_ids
    _, feats = target.forward(sequences, None, capture=ids)  # (N, L, n_ids*H)
    feats = mx.stop_gradient(feats)
    mx.eval(feats)
    N, L = sequences.shape
    mask_id = drafter.mask_token_id
    w = mx.array([math.exp(-(k - 1) / gamma) for k in range(1, B)])
    rng = np.random.default_rng(seed)

    def block_loss(model: DFlashDraftModel, p: int) -> mx.array:
        n_lab = min(B - 1, L - 1 - p)
        block = mx.concatenate(
            [sequences[:, p : p + 1], mx.full((N, B - 1), mask_id, dtype=mx.int32)], axis=1
        )
        logits = model(block, feats[:, :p], model.make_cache())[:, :n_lab]  # (N, n_lab, V)
        labels = sequences[:, p + 1 : p + 1 + n_lab]
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")  # (N, n_lab)
        return (ce * w[:n_lab]).sum() / (w[:n_lab].sum() * N)

    def loss_fn(model: DFlashDraftModel, ps: list[int]) -> mx.array:
        return sum(block_loss(model, p) for p in ps) / len(ps)

    opt = optim.Adam(learning_rate=lr)
    grad_fn = nn.value_and_grad(drafter, loss_fn)
    losses = []
    drafter.train()
    for _ in range(steps):
        ps = [int(x) for x in rng.integers(1, L - 1, size=anchors_per_step)]
        loss, grads = grad_fn(drafter, ps)
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss)
        losses.append(float(loss.item()))
    drafter.eval()
    return losses
