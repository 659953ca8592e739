"""The DFlash training objective: anchors, blocks, the block attention mask and the decayed loss.

What it does: for a batch of sequences with target features already computed, pick anchor
positions, build one block ``[x_a, MASK x (B-1)]`` per anchor at positions ``a .. a+B-1``, run all
blocks of a sequence through the drafter together, and score block position ``k`` against
``x_{a+k}`` with cross-entropy weighted by ``w_k = exp(-(k-1)/gamma)``, normalised by the sum of
the weights that count. The attention follows the inference semantics of
:class:`hf2q.runtime.drafter.DFlashAttention` exactly:

* a block's queries see the context rows (the drafter's projection of target features) at
  positions strictly before its anchor, and the rows of their own block; blocks never see each
  other;
* inside a block attention is non-causal unless the layer is causal (``is_causal``, or a sliding
  layer by z-lab's convention); sliding layers also hide keys ``window`` or more positions back.

Instead of one (A*B, T + A*B) mask, attention is computed in two parts that share one softmax:
block rows x context rows (masked by anchor), and each block's rows x its own rows. Memory grows
with A*B*(T + B), not (A*B)^2.

What it does not do: run the target, sample data, or own an optimizer (see ``trainer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from hf2q.runtime.drafter import DFlashAttention, DFlashDraftModel


def default_gamma(block_size: int) -> float:
    """Loss decay for block size B: 7 at B = 16 and 4 at B = 8 (the published values), linear in B."""
    return 1.0 + 3.0 * block_size / 8.0


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """``w_k = exp(-(k-1)/gamma)`` for block positions k = 1..B-1, shape (B-1,)."""
    k = np.arange(1, block_size, dtype=np.float64)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def valid_anchors(lengths: np.ndarray, loss_mask: np.ndarray, block_size: int) -> np.ndarray:
    """Where a block may start: (N, T) bool.

    Anchor ``a`` is valid when it has context (``a >= 1``), the whole block fits in the sequence
    (``a + B - 1 <= length - 1``) and its first label ``x_{a+1}`` is a response token.
    """
    N, T = loss_mask.shape
    pos = np.arange(T)[None, :]
    nxt = np.zeros_like(loss_mask)
    nxt[:, :-1] = loss_mask[:, 1:]
    return (pos >= 1) & (pos + block_size - 1 <= lengths[:, None] - 1) & nxt


def sample_anchors(
    valid: np.ndarray, per_seq: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Pick up to ``per_seq`` distinct valid anchors per sequence (sorted).

    Returns:
        ``(anchors, keep)``: (N, A) int32 positions and (N, A) bool, A = min(per_seq, most valid
        anchors of any row); rows with fewer valid anchors are padded with position 1 and
        ``keep`` False (their loss weight is zero).
    """
    counts = valid.sum(axis=1)
    A = int(min(per_seq, counts.max())) if counts.size else 0
    anchors = np.ones((valid.shape[0], max(A, 1)), dtype=np.int32)
    keep = np.zeros((valid.shape[0], max(A, 1)), dtype=bool)
    for n in range(valid.shape[0]):
        cand = np.flatnonzero(valid[n])
        if cand.size == 0:
            continue
        take = np.sort(rng.choice(cand, size=min(A, cand.size), replace=False))
        anchors[n, : take.size] = take
        keep[n, : take.size] = True
    return anchors[:, : max(A, 1)], keep


@dataclass
class Blocks:
    """Blocks of one batch, on the host. N sequences, A anchors each, block size B."""

    anchors: np.ndarray  # (N, A) int32
    tokens: np.ndarray  # (N, A, B) int32: [x_a, MASK, ..., MASK]
    labels: np.ndarray  # (N, A, B-1) int32: x_{a+1} .. x_{a+B-1}
    label_mask: np.ndarray  # (N, A, B-1) float32: 1 where the label counts


def make_blocks(
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    lengths: np.ndarray,
    anchors: np.ndarray,
    keep: np.ndarray,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """Block inputs, labels and label weights for the chosen anchors."""
    N, A = anchors.shape
    B = block_size
    block = np.full((N, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(tokens, anchors, axis=1)
    pos = anchors[:, :, None] + np.arange(1, B)[None, None, :]  # (N, A, B-1)
    inside = pos < lengths[:, None, None]
    pos_c = np.minimum(pos, tokens.shape[1] - 1)
    labels = np.take_along_axis(tokens, pos_c.reshape(N, -1), axis=1).reshape(N, A, B - 1)
    lm = np.take_along_axis(loss_mask, pos_c.reshape(N, -1), axis=1).reshape(N, A, B - 1)
    label_mask = (lm & inside & keep[:, :, None]).astype(np.float32)
    return Blocks(anchors.astype(np.int32), block, labels.astype(np.int32), label_mask)


def attention_masks(
    anchors: mx.array, ctx_len: int, block_size: int, *, causal: bool, window: int | None
) -> tuple[mx.array, mx.array]:
    """Visibility for block rows: (context part (N, A, B, T), own-block part (B, B)), bool.

    Row ``(n, j, b)`` is the query at position ``anchors[n, j] + b``; context key ``t`` is visible
    when ``t < anchors[n, j]`` (and, for sliding layers, fewer than ``window`` positions back);
    own-block key ``b'`` is visible always, or when ``b' <= b`` for causal layers.
    """
    a = anchors[:, :, None, None]  # (N, A, 1, 1)
    b = mx.arange(block_size)[None, None, :, None]  # (1, 1, B, 1)
    t = mx.arange(ctx_len)[None, None, None, :]  # (1, 1, 1, T)
    ctx = mx.broadcast_to(t < a, (anchors.shape[0], anchors.shape[1], block_size, ctx_len))
    qb = mx.arange(block_size)[:, None]
    kb = mx.arange(block_size)[None, :]
    own = mx.ones((block_size, block_size), dtype=mx.bool_)
    if causal:
        own = own & (kb <= qb)
    if window is not None:
        ctx = ctx & ((a + b) - t < window)
        own = own & (qb - kb < window)
    return ctx, own


def _block_attention(
    attn: DFlashAttention, x: mx.array, ctx: mx.array, anchors: mx.array
) -> mx.array:
    """One drafter layer's attention for all blocks: x (N*A, B, H) normed rows -> (N*A, B, H)."""
    N, A = anchors.shape
    NA, B, _ = x.shape
    T = ctx.shape[1]
    h, hk, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    g = h // hk  # query heads per kv head (query head i uses kv head i // g)
    pos = anchors.reshape(-1)
    q = attn.queries(x, pos) * attn.scale  # (NA, h, B, d)
    kb, vb = attn.keys_values(x, pos)  # (NA, hk, B, d)
    kc, vc = attn.keys_values(ctx, 0)  # (N, hk, T, d)

    # Rows ordered (a, g, b) within each (n, kv head): r = (j * g + gi) * B + b.
    qc = q.reshape(N, A, hk, g * B, d).transpose(0, 2, 1, 3, 4).reshape(N, hk, A * g * B, d)
    s_ctx = qc @ kc.swapaxes(-1, -2)  # (N, hk, A*g*B, T)
    s_own = q.reshape(NA, hk, g * B, d) @ kb.swapaxes(-1, -2)  # (NA, hk, g*B, B)
    s_own = s_own.reshape(N, A, hk, g * B, B).transpose(0, 2, 1, 3, 4).reshape(N, hk, A * g * B, B)

    vis_ctx, vis_own = attention_masks(
        anchors, T, B, causal=attn.is_causal, window=attn.sliding_window
    )
    vis_ctx = mx.broadcast_to(vis_ctx[:, :, None], (N, A, g, B, T)).reshape(N, 1, A * g * B, T)
    vis_own = mx.broadcast_to(vis_own[None], (A * g, B, B)).reshape(1, 1, A * g * B, B)
    visible = mx.concatenate(
        [mx.broadcast_to(vis_ctx, s_ctx.shape), mx.broadcast_to(vis_own, s_own.shape)], axis=-1
    )
    scores = mx.concatenate([s_ctx, s_own], axis=-1).astype(mx.float32)
    # Every row sees at least its own block position, so no row is all -inf.
    p = mx.softmax(mx.where(visible, scores, -mx.inf), axis=-1).astype(q.dtype)

    out = p[..., :T] @ vc  # (N, hk, A*g*B, d)
    p_own = (
        p[..., T:].reshape(N, hk, A, g * B, B).transpose(0, 2, 1, 3, 4).reshape(NA, hk, g * B, B)
    )
    out = out.reshape(N, hk, A, g * B, d).transpose(0, 2, 1, 3, 4).reshape(NA, hk, g * B, d)
    out = out + p_own @ vb  # (NA, hk, g*B, d)
    out = out.reshape(NA, h, B, d).transpose(0, 2, 1, 3).reshape(NA, B, h * d)
    return attn.o_proj(out)


def block_hidden(
    drafter: DFlashDraftModel, embeds: mx.array, features: mx.array, anchors: mx.array
) -> mx.array:
    """Final-normed drafter hidden states of every block row.

    Args:
        embeds: (N*A, B, H) target embeddings of the block tokens.
        features: (N, T, n_ids*H) target features of every sequence position.
        anchors: (N, A) int32 anchor positions.

    Returns:
        (N*A, B, H).
    """
    ctx = drafter.context(features)  # (N, T, H)
    h = embeds
    for layer in drafter.layers:
        h = h + _block_attention(layer.self_attn, layer.input_layernorm(h), ctx, anchors)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


@mx.compile
def _token_ce(logits: mx.array, labels: mx.array) -> mx.array:
    # Compiled: the vocabulary-sized passes (exp, sum, their gradients) fuse into fewer kernels.
    picked = mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return mx.logsumexp(logits, axis=-1) - picked


def decayed_loss(
    logits: mx.array, labels: mx.array, label_mask: mx.array, weights: mx.array
) -> tuple[mx.array, dict[str, mx.array]]:
    """Weighted cross-entropy of block positions 1..B-1 and training metrics.

    Args:
        logits: (M, B-1, V) draft logits; labels (M, B-1) int; label_mask (M, B-1) float;
            weights (B-1,) the decay ``w_k``.

    Returns:
        ``(loss, metrics)``: ``loss = sum(w * m * ce) / sum(w * m)``; metrics (not differentiated):
        ``weight`` (sum of w * m), ``correct`` (sum of w * m * [argmax == label]), ``leading``
        (sum over blocks of the number of leading correct drafts), ``blocks`` (blocks counted),
        ``pos_correct`` / ``pos_count`` (per block position).
    """
    logits = logits.astype(mx.float32)
    ce = _token_ce(logits, labels)  # (M, B-1)
    w = weights[None, :] * label_mask
    wsum = w.sum()
    loss = (w * ce).sum() / mx.maximum(wsum, 1e-9)
    correct = mx.stop_gradient((mx.argmax(logits, axis=-1) == labels).astype(mx.float32))
    counted_block = label_mask[:, 0] > 0
    lead = mx.cumprod(correct * label_mask, axis=-1).sum(axis=-1)
    metrics = {
        "weight": mx.stop_gradient(wsum),
        "correct": (w * correct).sum(),
        "leading": (lead * counted_block).sum(),
        "blocks": counted_block.sum(),
        "pos_correct": (correct * label_mask).sum(axis=0),
        "pos_count": label_mask.sum(axis=0),
    }
    return loss, metrics


def batch_loss(
    drafter: DFlashDraftModel,
    head: Any,
    embeds: mx.array,
    features: mx.array,
    blocks_anchors: mx.array,
    labels: mx.array,
    label_mask: mx.array,
    weights: mx.array,
) -> tuple[mx.array, dict[str, mx.array]]:
    """The training loss of one batch (what ``nn.value_and_grad`` differentiates).

    ``head`` maps hidden states to logits (the target's frozen lm_head); labels and label_mask are
    (N*A, B-1).
    """
    h = block_hidden(drafter, embeds, features, blocks_anchors)  # (N*A, B, H)
    logits = head(h[:, 1:])  # (N*A, B-1, V)
    return decayed_loss(logits, labels, label_mask, weights)


def expected_tau_from_accuracy(pos_acc: list[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: the acceptance length if position errors were independent."""
    tau, run = 1.0, 1.0
    for acc in pos_acc:
        run *= acc
        tau += run
    return tau if math.isfinite(tau) else float("nan")
