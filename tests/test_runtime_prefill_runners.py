"""Prompt chunks through the compiled layer runners (CUDA, unless ``HF2Q_PREFILL_RUNNERS=0``) compute what
the model's own layers compute.

Off Apple GPUs mlx-lm runs a prompt chunk's Gated-DeltaNet recurrence as a Python loop of small
ops per position; with the switch, :func:`hf2q.runtime.dflash.prefill` sends the chunks through the
runners plain decoding uses (on CUDA: one fused kernel per layer) and the last token through a
decode step. These tests make the runners the decoding path on this CPU (as they are on CUDA), so
the switch takes effect here, and check the prefilled caches and first logits against the
model's own layers, and greedy DFlash against plain decoding on top of them. The CUDA test checks
the fused kernel over a long chunk.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import FIT_TEXTS, assert_fitted_greedy_dflash_equals_plain, load_fitted
from mlx.utils import tree_flatten

from hf2q.errors import UsageError
from hf2q.kernels import layers, select
from hf2q.runtime import dflash
from hf2q.runtime.cache import make_target_cache
from hf2q.runtime.dflash import prefill

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def test_prefill_runners_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(select.PREFILL_RUNNERS_ENV, raising=False)
    assert select.prefill_runners_enabled()  # on by default (where the runners run: CUDA)
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "0")
    assert not select.prefill_runners_enabled()
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "1")
    assert select.prefill_runners_enabled()
    where = "compiled runners" if select.backend() == "cuda" else "the model's layers"
    assert f"prefill through {where}" in select.summary()
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "often")
    with pytest.raises(UsageError, match="HF2Q_PREFILL_RUNNERS='often' must be 0 or 1"):
        select.prefill_runners_enabled()


@pytest.fixture
def runners_here(monkeypatch):
    """The runners as this machine's decoding path (they are on CUDA), with the switch on."""
    monkeypatch.setattr(layers, "decode_runners_active", lambda: True)
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "1")


def _prefilled(target, drafter, prompt, step_size):
    cache, dcache = make_target_cache(target), drafter.make_cache()
    logits, feats = prefill(
        target, prompt, cache, drafter=drafter, draft_cache=dcache, step_size=step_size
    )
    state = [[c.state for c in cache], [c.state for c in dcache]]
    mx.eval(logits, feats, state)
    return logits, feats, state


def test_switch_off_or_no_runners_keeps_the_models_layers(monkeypatch):
    monkeypatch.setattr(layers, "decode_runners_active", lambda: True)
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "0")
    assert layers.prefill_layer_fn() is None
    monkeypatch.setattr(layers, "decode_runners_active", lambda: False)
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "1")
    assert layers.prefill_layer_fn() is None


@pytest.mark.parametrize(
    ("words", "step_size"),
    [(6, 2048), (40, 16), (3 * layers.MAX_OPS_STEPS, 2048)],
    ids=["one-chunk", "several-chunks", "longer-than-the-ops-runner"],
)
def test_runner_prefill_equals_the_models_layers(words, step_size, fitted_pairs, monkeypatch):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    text = " ".join([FIT_TEXTS[0], FIT_TEXTS[1], FIT_TEXTS[3]] * words)
    prompt = lm.tokenizer.encode(text)[: words * 3]
    want = _prefilled(target, drafter, prompt, step_size)
    monkeypatch.setattr(layers, "decode_runners_active", lambda: True)
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "1")
    made = layers.prefill_layer_fn
    calls = []

    def counted():  # the real layer function, its calls counted: prefill must use it
        fn = made()
        return lambda *a: calls.append(a[0]) or fn(*a)

    monkeypatch.setattr(dflash, "prefill_layer_fn", counted)
    got = _prefilled(target, drafter, prompt, step_size)
    chunks = -(-(len(prompt) - 1) // step_size)
    assert len(calls) == chunks * target.num_layers
    assert mx.allclose(got[0], want[0], rtol=1e-4, atol=1e-4).item(), "first logits"
    assert mx.allclose(got[1], want[1], rtol=1e-4, atol=1e-4).item(), "drafter features"
    flat_got, flat_want = tree_flatten(got[2]), tree_flatten(want[2])
    assert [k for k, _ in flat_got] == [k for k, _ in flat_want]
    for (k, a), (_, b) in zip(flat_got, flat_want, strict=True):
        if isinstance(a, mx.array):
            assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item(), f"cache {k}"
        else:
            assert a == b, f"cache {k}"


def test_greedy_dflash_after_a_runner_prefill_equals_plain(fitted_pairs, runners_here):
    assert_fitted_greedy_dflash_equals_plain(fitted_pairs, [20, 26, 14])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")
def test_runner_prefill_of_a_long_chunk_on_cuda(fitted_pairs, monkeypatch):
    # A 300-token chunk through the fused kernel (float32 model) against mlx-lm's layers.
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    prompt = [int(t) for t in mx.random.randint(3, 200, (301,), key=mx.random.key(7)).tolist()]
    monkeypatch.delenv(select.PREFILL_RUNNERS_ENV, raising=False)
    want = _prefilled(target, drafter, prompt, 2048)
    monkeypatch.setenv(select.PREFILL_RUNNERS_ENV, "1")
    assert layers.prefill_layer_fn() is not None
    got = _prefilled(target, drafter, prompt, 2048)
    assert mx.allclose(got[0], want[0], rtol=1e-3, atol=1e-3).item()
    assert mx.allclose(got[1], want[1], rtol=1e-3, atol=1e-3).item()
