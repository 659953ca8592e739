"""Queuing a verify forward every few layers (``HF2Q_FLUSH_LAYERS``; by default every 8 in lagged
rounds, never in synchronous ones) changes no value: only when the device starts on the layers.

On an H200 a Qwen3.5-4B-sized DFlash round is bound by the host building and encoding the verify's
graph; ``verify_forward`` queues it (``mx.async_eval``) every N layers so the device can compute
those layers meanwhile (no gain in synchronous rounds, docs/BENCHMARKS.md session 15; 12-14%
shorter lagged rounds with the draft queued first, session 22). These tests force it on this
CPU (every layer, every third) and check that
the verify's logits, captured features and rolled-back caches are bit-equal to the unqueued
forward's, and that greedy DFlash, single and batched, still equals plain greedy decoding.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import FIT_TEXTS, assert_fitted_greedy_dflash_equals_plain, load_fitted
from mlx.utils import tree_flatten

from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.runtime.cache import make_target_cache
from hf2q.runtime.dflash import prefill
from hf2q.runtime.verify import verify_forward


def test_flush_layers_reads_the_environment(monkeypatch):
    monkeypatch.delenv(select.FLUSH_LAYERS_ENV, raising=False)
    assert select.flush_layers() == 0  # synchronous rounds: no gain measured on the H200
    assert select.flush_layers(lagged=True) == select.LAGGED_FLUSH_LAYERS == 8
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "1")
    assert "verify queued every 8 layers" in select.summary()
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "0")
    assert "verify queued at the acceptance" in select.summary()
    monkeypatch.setenv(select.FLUSH_LAYERS_ENV, "3")
    assert select.flush_layers() == select.flush_layers(lagged=True) == 3
    assert "verify queued every 3 layers" in select.summary()
    monkeypatch.setenv(select.FLUSH_LAYERS_ENV, "0")
    assert select.flush_layers() == select.flush_layers(lagged=True) == 0
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "1")
    assert "verify queued at the acceptance" in select.summary()
    for bad in ("-1", "some"):
        monkeypatch.setenv(select.FLUSH_LAYERS_ENV, bad)
        with pytest.raises(UsageError, match="HF2Q_FLUSH_LAYERS=.*must be 0 .* fix or unset it"):
            select.flush_layers()


def _verify_then_rollback(target, drafter, prompt, block, keep):
    cache = make_target_cache(target)
    prefill(target, prompt, cache)
    ids = drafter.config.target_layer_ids
    logits, feats = verify_forward(target, mx.array([block], dtype=mx.int32), cache, capture=ids)
    cache.rollback(keep)
    state = [c.state for c in cache]
    mx.eval(logits, feats, state)
    return logits, feats, state


def test_queued_verify_is_bit_equal_to_one_queue(fitted_pairs, monkeypatch):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    prompt = lm.tokenizer.encode(FIT_TEXTS[1])
    block = [int(t) for t in mx.random.randint(0, 200, (16,), key=mx.random.key(3)).tolist()]
    monkeypatch.setenv(select.FLUSH_LAYERS_ENV, "0")
    want = _verify_then_rollback(target, drafter, prompt, block, 6)
    for every in ("1", "3"):
        monkeypatch.setenv(select.FLUSH_LAYERS_ENV, every)
        got = _verify_then_rollback(target, drafter, prompt, block, 6)
        assert mx.array_equal(got[0], want[0]).item(), f"logits, every {every}"
        assert mx.array_equal(got[1], want[1]).item(), f"features, every {every}"
        flat_got, flat_want = tree_flatten(got[2]), tree_flatten(want[2])
        assert [k for k, _ in flat_got] == [k for k, _ in flat_want]
        for (k, a), (_, b) in zip(flat_got, flat_want, strict=True):
            assert (a is None) == (b is None), k
            assert a is None or mx.array_equal(a, b).item(), f"cache state {k}, every {every}"


@pytest.mark.parametrize("every", ["1", "3"])
def test_greedy_dflash_with_a_queued_verify_equals_plain(every, fitted_pairs, monkeypatch):
    monkeypatch.setenv(select.FLUSH_LAYERS_ENV, every)
    assert_fitted_greedy_dflash_equals_plain(fitted_pairs, [24, 17, 30])
