"""The batched training forward, attention mask and decayed loss against a naive reference.

The reference runs the drafter's own inference path (``DFlashDraftModel.__call__`` with a fresh
KV cache) once per block, given only the context features strictly before that block's anchor,
and computes the loss with explicit Python loops.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel
from hf2q.train.objective import (
    attention_masks,
    block_hidden,
    decayed_loss,
    default_gamma,
    loss_weights,
    make_blocks,
    sample_anchors,
    valid_anchors,
)

H, V, B, MASK = 32, 97, 6, 96


def _drafter(**over) -> tuple[DFlashDraftModel, nn.Module, nn.Module]:
    cfg = DFlashConfig(
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=V,
        num_target_layers=4,
        target_layer_ids=[1, 2],
        mask_token_id=MASK,
        block_size=B,
        **over,
    )
    mx.random.seed(0)
    drafter = DFlashDraftModel(cfg)
    # Random norms too, so a wrong row or position cannot hide behind unit weights.
    drafter.update(
        {
            "hidden_norm": {"weight": 1 + 0.3 * mx.random.normal((H,))},
            "norm": {"weight": 1 + 0.3 * mx.random.normal((H,))},
        }
    )
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    drafter.bind(embed, head)
    mx.eval(drafter.parameters(), embed.parameters(), head.parameters())
    return drafter, embed, head


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    N, T = 3, 20
    tokens = rng.integers(0, MASK, size=(N, T)).astype(np.int32)
    lengths = np.array([20, 14, 9])
    loss_mask = np.ones((N, T), dtype=bool)
    loss_mask[0, :5] = False  # a "prompt" whose tokens are never labels
    loss_mask[np.arange(T)[None, :] >= lengths[:, None]] = False
    features = mx.array(rng.standard_normal((N, T, 2 * H)).astype(np.float32))
    valid = valid_anchors(lengths, loss_mask, B)
    anchors, keep = sample_anchors(valid, 5, rng)
    blocks = make_blocks(tokens, loss_mask, lengths, anchors, keep, B, MASK)
    return tokens, lengths, loss_mask, features, blocks, keep


def test_valid_anchors_need_context_a_whole_block_and_a_response_label():
    lengths = np.array([10])
    loss_mask = np.ones((1, 12), dtype=bool)
    loss_mask[0, :4] = False
    valid = valid_anchors(lengths, loss_mask, 4)
    # a >= 1, a + 3 <= 9, x_{a+1} response (a + 1 >= 4)
    assert np.flatnonzero(valid[0]).tolist() == [3, 4, 5, 6]


def test_blocks_hold_the_anchor_token_then_masks_and_labels_are_the_next_tokens():
    tokens, lengths, loss_mask, _, blocks, keep = _batch()
    N, A = blocks.anchors.shape
    for n in range(N):
        for j in range(A):
            a = int(blocks.anchors[n, j])
            assert blocks.tokens[n, j, 0] == tokens[n, a]
            assert (blocks.tokens[n, j, 1:] == MASK).all()
            if keep[n, j]:
                assert blocks.labels[n, j].tolist() == tokens[n, a + 1 : a + B].tolist()
                assert blocks.label_mask[n, j].tolist() == loss_mask[n, a + 1 : a + B].tolist()
            else:
                assert not blocks.label_mask[n, j].any()


def test_gamma_defaults_match_the_published_values_and_weights_decay():
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0
    w = loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    assert np.allclose(w, [math.exp(-(k - 1) / 7.0) for k in range(1, 16)])


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"is_causal": True},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
        {
            "layer_types": ["sliding_attention", "sliding_attention"],
            "sliding_window": 7,
            "is_causal": False,
        },
    ],
    ids=["non-causal", "causal", "sliding-causal", "sliding-non-causal"],
)
def test_batched_block_logits_equal_the_inference_path_run_per_block(over):
    drafter, embed, head = _drafter(**over)
    tokens, lengths, loss_mask, features, blocks, keep = _batch()
    N, A = blocks.anchors.shape
    embeds = embed(mx.array(blocks.tokens.reshape(N * A, B)))
    h = block_hidden(drafter, embeds, features, mx.array(blocks.anchors))
    batched = np.array(head(h[:, 1:]))  # (N*A, B-1, V)
    for n in range(N):
        for j in range(A):
            a = int(blocks.anchors[n, j])
            ref = drafter(
                mx.array(blocks.tokens[n, j])[None], features[n : n + 1, :a], drafter.make_cache()
            )
            np.testing.assert_allclose(batched[n * A + j], np.array(ref[0]), atol=2e-5, rtol=1e-4)


def test_a_block_never_sees_another_block_or_its_own_future_context():
    drafter, embed, head = _drafter()
    tokens, lengths, loss_mask, features, blocks, keep = _batch()
    N, A = blocks.anchors.shape
    anchors = mx.array(blocks.anchors)

    def logits(toks, feats):
        e = embed(mx.array(toks.reshape(N * A, B)))
        return np.array(head(block_hidden(drafter, e, feats, anchors)[:, 1:]))

    base = logits(blocks.tokens, features)
    # Change another block's anchor token and every feature at or after block (0, 0)'s anchor.
    toks = blocks.tokens.copy()
    toks[0, 1, 0] = (toks[0, 1, 0] + 1) % MASK
    a0 = int(blocks.anchors[0, 0])
    feats = np.array(features)
    feats[0, a0:] += 5.0
    moved = logits(toks, mx.array(feats))
    np.testing.assert_allclose(moved[0], base[0], atol=1e-5)
    assert not np.allclose(moved[1], base[1], atol=1e-3)  # block (0, 1) did change


def test_attention_mask_matches_the_rule_written_out():
    anchors = mx.array([[2, 5]])
    ctx, own = attention_masks(anchors, 8, 3, causal=True, window=4)
    ctx, own = np.array(ctx), np.array(own)
    for j, a in enumerate([2, 5]):
        for b in range(3):
            for t in range(8):
                assert ctx[0, j, b, t] == (t < a and (a + b) - t < 4)
    for b in range(3):
        for b2 in range(3):
            assert own[b, b2] == (b2 <= b and b - b2 < 4)


def test_decayed_loss_equals_the_weighted_mean_written_out():
    drafter, embed, head = _drafter()
    tokens, lengths, loss_mask, features, blocks, keep = _batch(seed=3)
    N, A = blocks.anchors.shape
    gamma = 2.5
    w = loss_weights(B, gamma)
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((N * A, B - 1, V)).astype(np.float32) * 3
    labels = blocks.labels.reshape(N * A, B - 1)
    lmask = blocks.label_mask.reshape(N * A, B - 1)
    loss, metrics = decayed_loss(mx.array(logits), mx.array(labels), mx.array(lmask), mx.array(w))
    num = den = correct = 0.0
    leading = blocks_counted = 0
    for m in range(N * A):
        lead_run = True
        n_lead = 0
        for k in range(1, B):
            if lmask[m, k - 1] == 0:
                lead_run = False
                continue
            row = logits[m, k - 1].astype(np.float64)
            ce = np.log(np.exp(row - row.max()).sum()) + row.max() - row[labels[m, k - 1]]
            wk = math.exp(-(k - 1) / gamma)
            num += wk * ce
            den += wk
            hit = row.argmax() == labels[m, k - 1]
            correct += wk * hit
            if lead_run and hit:
                n_lead += 1
            else:
                lead_run = False
        if lmask[m, 0]:
            blocks_counted += 1
            leading += n_lead
    assert float(loss) == pytest.approx(num / den, rel=1e-5)
    assert float(metrics["weight"]) == pytest.approx(den, rel=1e-6)
    assert float(metrics["correct"]) == pytest.approx(correct, rel=1e-6)
    assert int(metrics["blocks"]) == blocks_counted
    assert float(metrics["leading"]) == leading
