"""Bucket-padded attention keys (``HF2Q_SDPA_BUCKET``; on by default on CUDA) change no result.

On MLX's CUDA backend every new (query length, key length) of a half-precision multi-token
attention builds a cuDNN graph; padding the keys of verify and drafting to a bucket keeps that
shape fixed. These tests force a small bucket on this CPU and check that the padded caches and
the padded drafter attention compute what the exact-length ones compute, and that greedy DFlash,
single and batched, still equals plain greedy decoding.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import FIT_TEXTS, assert_greedy_dflash_equals_plain, load_fitted
from mlx_lm.models.cache import KVCache

from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.runtime.cache import BucketedKVCache, make_target_cache
from hf2q.runtime.slot_cache import SlotKVCache, make_slot_target_cache


def _attend(q, cache, k_new, v_new):
    mask = cache.make_mask(q.shape[2], return_array=False, window_size=None)
    k, v = cache.update_and_fetch(k_new, v_new)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask), k.shape[2]


def test_sdpa_bucket_reads_the_environment(monkeypatch):
    monkeypatch.delenv(select.SDPA_BUCKET_ENV, raising=False)
    # Off on CPUs and Apple GPUs (nothing is built per shape there), mlx-lm's step on CUDA.
    default = select.SDPA_BUCKET_CUDA if select.backend() == "cuda" else None
    assert select.sdpa_bucket() == default
    monkeypatch.setenv(select.SDPA_BUCKET_ENV, "32")
    assert select.sdpa_bucket() == 32
    monkeypatch.setenv(select.SDPA_BUCKET_ENV, "0")
    assert select.sdpa_bucket() is None
    for bad in ("-4", "many"):
        monkeypatch.setenv(select.SDPA_BUCKET_ENV, bad)
        with pytest.raises(UsageError, match="HF2Q_SDPA_BUCKET=.*must be 0 .* fix or unset it"):
            select.sdpa_bucket()
    assert [select.bucketed(n, 16) for n in (1, 16, 17, 40)] == [16, 16, 32, 48]
    assert select.bucketed(17, None) == 17


def test_bucketed_kv_cache_attends_exactly_like_mlx_lm_kv_cache():
    mx.random.seed(0)
    H, D = 2, 16
    plain, padded = KVCache(), BucketedKVCache(8)
    # Prefill, verify blocks, single decode steps and rollbacks (trim), crossing buckets and
    # mlx-lm's 256-position buffer step (a trimmed regrowth leaves a non-multiple capacity).
    schedule = [(5, 0), (4, 2), (1, 0), (16, 9), (1, 0), (230, 0), (16, 3), (16, 0), (3, 1)]
    for step, (L, trim) in enumerate(schedule):
        q = mx.random.normal((1, H, L, D))
        k = mx.random.normal((1, H, L, D))
        v = mx.random.normal((1, H, L, D))
        want, n_keys = _attend(q, plain, k, v)
        got, n_padded = _attend(q, padded, k, v)
        assert mx.allclose(got, want, atol=1e-5).item(), f"step {step}"
        if L > 1:
            assert n_padded % 8 == 0 and n_keys <= n_padded < n_keys + 8
        else:
            assert n_padded == n_keys  # plain decoding is mlx-lm's own path
        assert padded.offset == plain.offset
        plain.trim(trim)
        padded.trim(trim)


def test_slot_kv_cache_with_a_bucket_attends_like_without():
    mx.random.seed(1)
    H, D, rows = 2, 8, 3
    exact, padded = SlotKVCache(rows), SlotKVCache(rows, bucket=16)
    for cache in (exact, padded):
        for r, n in enumerate((3, 11, 6)):  # ragged rows
            k = mx.random.normal((1, H, n, D), key=mx.random.key(r))
            cache.insert(r, k, -k, n)
    for step, (L, drop) in enumerate([(4, [1, 0, 3]), (16, [15, 2, 0]), (1, [0, 0, 0])]):
        q = mx.random.normal((rows, H, L, D))
        k = mx.random.normal((rows, H, L, D))
        v = mx.random.normal((rows, H, L, D))
        want, _ = _attend(q, exact, k, v)
        got, n_keys = _attend(q, padded, k, v)
        assert mx.allclose(got, want, atol=1e-5).item(), f"step {step}"
        if L > 1:
            assert n_keys % 16 == 0
        exact.rollback(drop)
        padded.rollback(drop)
        assert exact.lengths == padded.lengths


@pytest.fixture
def bucket16(monkeypatch):
    monkeypatch.setenv(select.SDPA_BUCKET_ENV, "16")


def test_drafter_logits_with_padded_keys_equal_exact_ones(fitted_pairs, monkeypatch):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    feats = mx.random.normal((1, 21, len(drafter.config.target_layer_ids) * target.hidden_size))
    block = mx.array([[5] + [drafter.mask_token_id] * 15])
    outs = []
    for bucket in ("0", "16"):
        monkeypatch.setenv(select.SDPA_BUCKET_ENV, bucket)
        cache = drafter.make_cache()
        drafter.add_context(feats[:, :20], cache)
        outs.append(drafter(block, feats[:, 20:], cache))
    assert mx.allclose(outs[0], outs[1], atol=1e-4).item()


@pytest.mark.parametrize("name", ["qwen35", "qwen35_causal"])
def test_greedy_dflash_with_padded_keys_equals_plain(name, fitted_pairs, bucket16):
    lm, target, drafter = load_fitted(*fitted_pairs[name])
    assert any(isinstance(c, BucketedKVCache) for c in make_target_cache(target))
    assert all(c.bucket == 16 for c in make_slot_target_cache(target, 2) if hasattr(c, "bucket"))
    prompts = [lm.tokenizer.encode(t)[:4] for t in FIT_TEXTS[:3]] + [
        lm.tokenizer.encode(FIT_TEXTS[0] + " " + FIT_TEXTS[3])
    ]
    assert_greedy_dflash_equals_plain(
        target,
        drafter,
        prompts,
        [40 - 5 * i for i in range(len(prompts))],
        blocks=(4, 16),
        slots=3,
        eos=lm.tokenizer.eos_token_ids,
    )


def _attention_inputs(monkeypatch, cache, target, prompt):
    """(keys length, mask kind) of every attention call while ``prompt`` is prefilled."""
    from hf2q.runtime.dflash import prefill

    seen = []
    sdpa = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *args, mask=None, **kwargs):
        kind = mask if mask is None or isinstance(mask, str) else f"array{tuple(mask.shape)}"
        seen.append((q.shape[2], k.shape[2], kind))
        return sdpa(q, k, v, *args, mask=mask, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(mx.fast, "scaled_dot_product_attention", spy)
        logits, _ = prefill(target, prompt, cache, step_size=7)
    return seen, logits


def test_prefill_into_the_bucketed_cache_attends_like_plain_decoding(
    fitted_pairs, bucket16, monkeypatch
):
    # On CUDA a prompt chunk over bucket-padded keys with an array mask rounds differently from
    # mlx-lm's unpadded causal call (the 4B-shaped pair on an H200 lost greedy equality from its
    # first token): DFlash's prefill must hand the attention exactly plain decoding's inputs.
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    prompt = lm.tokenizer.encode(FIT_TEXTS[0] + " " + FIT_TEXTS[3])[:30]
    dflash_cache = make_target_cache(target)
    got, logits = _attention_inputs(monkeypatch, dflash_cache, target, prompt)
    want, plain_logits = _attention_inputs(monkeypatch, target.make_cache(), target, prompt)
    assert got == want and any(kind == "causal" for _, _, kind in got)
    assert mx.array_equal(logits, plain_logits)
    # The bucket is back for the verify blocks that follow.
    assert all(c.bucket == 16 for c in dflash_cache if isinstance(c, BucketedKVCache))


@pytest.mark.skipif(select.backend() != "cuda", reason="the rounding difference is CUDA's")
def test_bf16_prefill_is_bit_equal_in_both_caches_at_4b_width():
    # Four layers of Qwen3.5-4B's widths (three Gated-DeltaNet, one attention), random bf16
    # weights, a 1024-token prompt: where session 17's H200 run found the caches parting.
    import sys
    from pathlib import Path

    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    from hf2q.runtime.dflash import prefill
    from hf2q.runtime.target import TargetModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from shapes import QWEN35_4B_TARGET

    mx.random.seed(0)
    text = dict(QWEN35_4B_TARGET, num_hidden_layers=4, vocab_size=4096, model_type="qwen3_5_text")
    model = qwen3_5.Model(
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text})
    )
    model.set_dtype(mx.bfloat16)
    for layer in model.language_model.model.layers:
        if layer.is_linear:
            layer.linear_attn.A_log = layer.linear_attn.A_log.astype(mx.float32)
    target = TargetModel(model)
    prompt = mx.random.randint(0, 4096, (1024,), key=mx.random.key(3)).tolist()
    ours, plain = make_target_cache(target), target.make_cache()
    assert any(isinstance(c, BucketedKVCache) for c in ours)
    a, _ = prefill(target, prompt, ours)
    b, _ = prefill(target, prompt, plain)
    assert mx.array_equal(a, b)
    for i, (x, y) in enumerate(zip(ours, plain)):
        sx, sy = tree_flatten(x.state), tree_flatten(y.state)
        assert len(sx) == len(sy), f"layer {i}"
        for (_, u), (_, w) in zip(sx, sy):  # None: a state not written (both sides alike)
            assert (u is None and w is None) or mx.array_equal(u, w), f"layer {i}"
