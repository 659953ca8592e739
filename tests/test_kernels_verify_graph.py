"""A single sequence's verify forward as one compiled graph (``HF2Q_COMPILE_VERIFY``) computes and
records what the layer-by-layer verify does.

The graph writes each attention layer's block of KV rows at the position given as an array and,
off CUDA, attends over the whole buffer with each row's later positions masked out (on CUDA the
row-invariant kernel, where DFlash takes the graph by default). These tests force it on this CPU
with the layer runners made the verify path, as on CUDA, and check it against the layer path:
logits, the drafter's features, and every cache after rollbacks of each kind of record; then
greedy DFlash through it against plain greedy decoding on several prompts and block sizes. On
CUDA, ``tests/test_runtime_bf16_exact.py`` checks the graph's rows bit for bit against decode
steps (``block_and_steps`` verifies through it).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import FIT_TEXTS, assert_fitted_batched_equals_plain, load_fitted
from mlx_lm.models.cache import KVCache, RotatingKVCache

from hf2q.kernels import layers, select
from hf2q.kernels.forward import CompiledVerify
from hf2q.kernels.gdn import RowReplay
from hf2q.runtime import verify
from hf2q.runtime.cache import make_target_cache
from hf2q.runtime.dflash import dflash_generate, plain_generate, prefill, run


@pytest.fixture
def runners_on(monkeypatch):
    """Verify and plain decoding through the compiled layer runners, as on CUDA."""
    monkeypatch.setattr(layers, "decode_runners_active", lambda: True)
    monkeypatch.setattr(verify, "decode_runners_active", lambda: True)
    monkeypatch.delenv(select.COMPILE_ENV, raising=False)  # (HF2Q_COMPILE=0: no runners, no graph)
    monkeypatch.setenv(select.COMPILE_VERIFY_ENV, "1")


def _prefilled(target, prompt):
    cache = make_target_cache(target.model)
    logits, _ = prefill(target, prompt, cache)
    mx.eval(logits, cache.state)
    return cache


def test_off_cuda_by_default_the_layer_path_verifies(fitted_pairs, monkeypatch):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    cache = _prefilled(target, lm.tokenizer.encode(FIT_TEXTS[0]))
    monkeypatch.delenv(select.COMPILE_VERIFY_ENV, raising=False)
    monkeypatch.delenv(select.COMPILE_ENV, raising=False)
    if select.backend() != "cuda":
        assert verify.whole_verify(target, cache, 8, drafter.config.target_layer_ids) is None
    monkeypatch.setattr(verify, "decode_runners_active", lambda: True)
    # float32 attends with MLX's attention: its bits need not be the layer path's, so only forced
    assert verify.whole_verify(target, cache, 8) is None
    monkeypatch.setenv(select.COMPILE_VERIFY_ENV, "1")
    assert isinstance(verify.whole_verify(target, cache, 8), CompiledVerify)
    monkeypatch.setenv(select.COMPILE_VERIFY_ENV, "0")
    assert verify.whole_verify(target, cache, 8) is None


@pytest.mark.parametrize("record", ["states", "final"])
def test_the_graph_equals_the_layer_path_and_rolls_back_alike(
    record, fitted_pairs, runners_on, monkeypatch
):
    monkeypatch.setenv(select.GDN_RECORD_ENV, record)
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    ids = drafter.config.target_layer_ids
    prompt = lm.tokenizer.encode(" ".join(FIT_TEXTS * 40))[:247]  # the buffer grows at 256
    graph_cache, layer_cache = _prefilled(target, prompt), _prefilled(target, prompt)
    whole = verify.whole_verify(target, graph_cache, 6, ids)
    assert isinstance(whole, CompiledVerify) and whole.block == 6
    vocab = target.vocab_size
    for r, keep in enumerate([6, 2, 1, 5, 3]):  # a full accept, partial ones, none
        block = mx.random.randint(0, vocab, (1, 6), key=mx.random.key(r)).astype(mx.int32)
        got = verify.verify_forward(target, block, graph_cache, capture=ids, whole=whole)
        want = verify.verify_forward(target, block, layer_cache, capture=ids)
        if record == "final":  # replays that a rollback can join (gdn.replay_layers)
            caches = [*graph_cache, *layer_cache]
            recs = [c.record for c in caches if hasattr(c, "record")]
            assert recs and all(isinstance(x.replay, RowReplay) for x in recs)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            assert mx.allclose(g, w, rtol=1e-5, atol=1e-5).item(), f"round {r}"
        graph_cache.rollback(keep)
        layer_cache.rollback(keep)
        mx.eval(graph_cache.state, layer_cache.state)
        for a, b in zip(graph_cache, layer_cache, strict=True):
            if hasattr(a, "keys"):
                n = b.offset
                assert a.offset == n, f"round {r}"
                for x, y in ((a.keys, b.keys), (a.values, b.values)):
                    assert mx.allclose(x[..., :n, :], y[..., :n, :], atol=1e-6).item()
            else:
                assert a.record is None and b.record is None
                assert mx.allclose(a[0], b[0], atol=1e-6).item(), f"round {r} conv"
                assert mx.allclose(a[1], b[1], rtol=1e-5, atol=1e-6).item(), f"round {r} state"
    assert graph_cache.offset > 256  # past a buffer growth (a new trace)


def test_blocks_of_another_length_keep_the_layer_path(fitted_pairs, runners_on, monkeypatch):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    cache = _prefilled(target, lm.tokenizer.encode(FIT_TEXTS[1]))
    whole = verify.whole_verify(target, cache, 8)
    calls = []
    monkeypatch.setattr(CompiledVerify, "__call__", lambda self, *a: calls.append(a))
    logits, _ = verify.verify_forward(target, mx.array([[1, 2, 3]]), cache, whole=whole)
    assert logits.shape[:2] == (1, 3) and calls == []  # a generation's last, shorter block


def test_other_caches_keep_the_layer_path(fitted_pairs, runners_on):
    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    assert not CompiledVerify.supports(target, make_target_cache(target.model))  # not prefilled
    cache = _prefilled(target, lm.tokenizer.encode(FIT_TEXTS[0]))
    assert CompiledVerify.supports(target, cache)
    assert not CompiledVerify.supports(target, target.make_cache())  # no rollback records
    i = next(i for i, c in enumerate(cache) if isinstance(c, KVCache))
    cache[i] = RotatingKVCache(max_size=64)  # a sliding window's cache: not this graph's layout
    assert not CompiledVerify.supports(target, cache)
    assert verify.whole_verify(target, cache, 4) is None


def test_greedy_dflash_through_the_graph_equals_plain(fitted_pairs, runners_on, monkeypatch):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    prompts = [lm.tokenizer.encode(t) for t in FIT_TEXTS[:4]]
    eos = lm.tokenizer.eos_token_ids
    calls = []
    real = CompiledVerify.__call__

    def counted(self, *a):  # the real graph; count that the rounds ran it
        calls.append(self.block)
        return real(self, *a)

    monkeypatch.setattr(CompiledVerify, "__call__", counted)
    for i, prompt in enumerate(prompts):
        n = 20 + 7 * i
        want = run(plain_generate(target, prompt, max_tokens=n, eos_token_ids=eos)).tokens
        for B in (2, 5, 16):
            events = dflash_generate(
                target, drafter, prompt, max_tokens=n, block_size=B, eos_token_ids=eos, lagged=False
            )
            assert run(events).tokens == want, f"prompt {i} block {B}"
    assert {2, 5, 16} <= set(calls)


def test_the_traced_verify_is_kept_per_target_and_goes_with_it(fitted_pairs):
    import gc

    from hf2q.kernels import forward

    gc.collect()
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    first = CompiledVerify(target, capture=(1, 2), block=4)
    fn = first.graph("states")[1]
    # another block length (shapes: MLX's traces) and a later generation replay the same graph
    assert CompiledVerify(target, capture=(1, 2), block=8).graph("states")[1] is fn
    assert CompiledVerify(target, capture=(1,)).graph("states")[1] is not fn
    assert first.graph("final")[1] is not fn
    n = len(forward._verifies)
    del first, target, lm, drafter
    gc.collect()
    assert len(forward._verifies) == n - 1


@pytest.mark.parametrize("lagged,flush", [(False, None), (True, None), (True, "0")])
def test_batched_rounds_through_the_graph_equal_plain(
    lagged, flush, fitted_pairs, runners_on, monkeypatch
):
    # Slot caches: a position per row, rows finishing at different times and the queue refilling
    # them (continuous batching, the batch compacted), lagged rounds moving offsets on the device.
    # Lagged rounds queue the graph as soon as it is built (HF2Q_FLUSH_LAYERS unset), or with the
    # acceptance and the rollback (0).
    if flush is not None:
        monkeypatch.setenv("HF2Q_FLUSH_LAYERS", flush)
    rows = []
    real = CompiledVerify.__call__

    def counted(self, tokens, cache):  # the real graph; count the rows it verified
        rows.append(tokens.shape[0])
        return real(self, tokens, cache)

    monkeypatch.setattr(CompiledVerify, "__call__", counted)
    assert_fitted_batched_equals_plain(fitted_pairs, lagged=lagged)
    assert 3 in rows  # the rounds of full blocks ran the graph over the batch


def test_the_graphs_buffers_grow_in_large_steps():
    from hf2q.kernels.forward import GRAPH_GROW, graph_capacity

    # at least what is needed, at least GRAPH_GROW or half the buffer more, in steps of 256
    assert graph_capacity(257, 256) == 256 + GRAPH_GROW == 1280
    assert graph_capacity(3000, 1280) == 3072  # more needed than the step gives
    assert graph_capacity(4100, 4096) == 6144  # half again
    assert all(graph_capacity(n, h) % 256 == 0 for n, h in [(300, 17), (9999, 8000)])


def test_a_long_run_traces_the_graph_again_rarely(fitted_pairs, runners_on, monkeypatch):
    # Each buffer growth is a new trace of the whole forward: 300 positions of rounds grow the
    # buffer once (at 256), not every 256 positions as mlx-lm's own growth would.
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    cache = _prefilled(target, lm.tokenizer.encode(FIT_TEXTS[0])[:8])
    ids = drafter.config.target_layer_ids
    whole = verify.whole_verify(target, cache, 4, ids)
    rounds = []
    real = whole.graph

    def graph(record):
        rounds.append(record)
        return real(record)

    whole.graph = graph
    sizes = set()
    for r in range(80):
        block = mx.array([[r % 50 + j for j in range(4)]], dtype=mx.int32)
        out = verify.verify_forward(target, block, cache, capture=ids, whole=whole)
        mx.eval(out)
        cache.rollback(4)
        sizes.add(next(c.keys.shape[2] for c in cache if hasattr(c, "keys")))
    assert cache.offset == 8 + 80 * 4 and len(rounds) == 80  # every round through the graph
    assert sizes == {256, 1280}
