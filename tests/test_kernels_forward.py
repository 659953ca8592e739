"""A whole plain decode step as one compiled graph (``HF2Q_COMPILE_FORWARD``) computes what the
layer-by-layer runners compute (and the switches of it and of the verify's graph read the
environment).

The compiled step writes each attention layer's KV buffer at the position given as an array and
attends over the whole buffer (the positions after the token masked), so one trace serves every
step until mlx-lm's buffer grows. These tests run it on this CPU (MLX's attention; on CUDA the
row-invariant kernel) against the runners' steps and mlx-lm's own model, across a buffer growth,
and through plain decoding with the switch (the runners made the decoding path here, as on CUDA).
Plain decoding takes the step by default only where its bits are the layer path's (the
row-invariant attention kernel: ``CompiledDecode.exact``); on CUDA a test checks those bits.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import FIT_TEXTS, load_fitted
from mlx_lm.models.cache import KVCache, RotatingKVCache

from hf2q.errors import UsageError
from hf2q.kernels import layers, select
from hf2q.kernels.forward import CompiledDecode
from hf2q.runtime.dflash import plain_generate, prefill, run


def _prefilled(target, prompt):
    cache = target.make_cache()
    logits, _ = prefill(target, prompt, cache)
    mx.eval(logits, [c.state for c in cache])
    return logits, cache


@pytest.mark.parametrize(
    "env, enabled, forced, text, bad",
    [
        (
            select.COMPILE_FORWARD_ENV,
            select.compile_forward_enabled,
            select.compile_forward_forced,
            "decode step one compiled graph",
            "yes please",
        ),
        (  # the verify's graph (tests/test_kernels_verify_graph.py)
            select.COMPILE_VERIFY_ENV,
            select.compile_verify_enabled,
            select.compile_verify_forced,
            "verify one compiled graph (full blocks)",
            "twice",
        ),
    ],
)
def test_compile_switches_read_the_environment(env, enabled, forced, text, bad, monkeypatch):
    on_cuda = select.backend() == "cuda"
    monkeypatch.delenv(env, raising=False)
    assert enabled() == on_cuda  # default on CUDA only
    assert not forced()
    assert (f"{text} where attention is" in select.summary()) == on_cuda
    monkeypatch.setenv(env, "1")
    assert enabled() and forced()
    assert (text in select.summary()) == on_cuda
    monkeypatch.setenv(env, "0")
    assert not enabled() and not forced()
    monkeypatch.setenv(env, bad)
    with pytest.raises(UsageError, match=f"{env}='{bad}' must be 0 or 1"):
        enabled()


def test_compiled_steps_equal_the_runners_and_mlx_lm_across_a_buffer_growth(fitted_pairs):
    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    text = " ".join(FIT_TEXTS * 40)
    prompt = lm.tokenizer.encode(text)[:250]  # mlx-lm's buffer grows at 256: crossed below
    _, whole_cache = _prefilled(target, prompt)
    _, runner_cache = _prefilled(target, prompt)
    _, own_cache = _prefilled(target, prompt)
    assert CompiledDecode.supports(target, whole_cache)
    whole = CompiledDecode(target)
    fast = layers.fast_layer_fn()
    tok = mx.array([[prompt[-1]]], dtype=mx.int32)
    for step in range(12):
        got = whole(tok, whole_cache)
        want, _ = target.forward(tok, runner_cache, layer_fn=fast)
        own = lm.model(tok, cache=own_cache)
        assert got.shape == want.shape == own.shape
        # Close, not bit for bit: this step attends with MLX's attention over the whole masked
        # buffer (float32 has no row-invariant kernel), which on an H200 rounded differently
        # from the layer path's attention over the used slice at the 7th step (session 38):
        # why plain decoding takes the compiled step only where ``CompiledDecode.exact`` holds.
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), f"step {step}"
        assert mx.allclose(got, own, rtol=1e-4, atol=1e-4).item(), f"step {step}"
        tok = mx.argmax(own[:, -1:], axis=-1).astype(mx.int32)
    for a, b in zip(whole_cache, runner_cache, strict=True):
        assert getattr(a, "offset", None) == getattr(b, "offset", None)
        if hasattr(a, "keys"):
            n = b.offset
            assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-5).item()
        else:
            assert mx.allclose(a[1], b[1], rtol=1e-4, atol=1e-5).item()


def test_other_caches_keep_the_layer_path(fitted_pairs):
    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    assert not CompiledDecode.supports(target, target.make_cache())  # nothing prefilled yet
    _, cache = _prefilled(target, lm.tokenizer.encode(FIT_TEXTS[0]))
    assert CompiledDecode.supports(target, cache)
    i = next(i for i, c in enumerate(cache) if isinstance(c, KVCache))
    cache[i] = RotatingKVCache(max_size=64)  # a sliding window's cache: not this step's layout
    assert not CompiledDecode.supports(target, cache)


def test_plain_decoding_with_the_switch_gives_the_same_tokens(fitted_pairs, monkeypatch):
    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    monkeypatch.setattr(layers, "decode_runners_active", lambda: True)  # as on CUDA
    prompts = [lm.tokenizer.encode(t) for t in FIT_TEXTS[:3]]
    want = [run(plain_generate(target, p, max_tokens=24)).tokens for p in prompts]
    monkeypatch.setenv(select.COMPILE_FORWARD_ENV, "1")
    built = []
    real = CompiledDecode.__init__

    def counted(self, *a, **k):  # the real class; count that plain decoding made one
        built.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(CompiledDecode, "__init__", counted)
    got = [run(plain_generate(target, p, max_tokens=24)).tokens for p in prompts]
    assert built == [1, 1, 1]
    assert got == want


def test_the_step_is_exact_only_where_attention_is_the_row_invariant_kernel(fitted_pairs):
    from hf2q.runtime.pair import load_pair

    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    assert target.dtype == mx.float32
    assert not CompiledDecode.exact(target, rows=True)  # no row-invariant kernel for float32
    lm.model.set_dtype(mx.bfloat16)
    assert not CompiledDecode.exact(target, rows=True)  # heads of 16: not a multiple of 32
    demo = load_pair(None).target  # bf16, heads of 64
    assert CompiledDecode.exact(demo, rows=True)
    assert not CompiledDecode.exact(demo, rows=False)  # MLX's attention over the whole buffer


def test_the_traced_step_is_kept_per_target_and_goes_with_it(fitted_pairs):
    import gc

    from hf2q.kernels import forward

    gc.collect()  # targets of earlier tests, whose steps go with them
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    first, later = CompiledDecode(target), CompiledDecode(target)
    assert later._fn is first._fn  # a later generation replays the same compiled step
    assert CompiledDecode(target, mm=True)._fn is not first._fn
    n = len(forward._steps)
    del first, later, target, lm, drafter  # the drafter is bound to the target's methods
    gc.collect()
    assert len(forward._steps) == n - 1


HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def _side_by_side(target, prompt, steps: int, same) -> None:
    """Decode ``steps`` tokens after ``prompt`` with the compiled step and with the layer runners
    (the small-M product and row-invariant attention kernels in both), each from its own prefill,
    and check each step's logits with ``same(compiled, runners)``."""
    _, whole_cache = _prefilled(target, prompt)
    _, runner_cache = _prefilled(target, prompt)
    whole = CompiledDecode(target, mm=True, rows=True)
    fast = layers.fast_layer_fn(mm=True, rows=True)
    tok = mx.array([[prompt[-1]]], dtype=mx.int32)
    for step in range(steps):
        got = whole(tok, whole_cache)
        want, _ = target.forward(tok, runner_cache, layer_fn=fast, mm=True)
        assert same(got, want).item(), f"step {step}"
        tok = mx.argmax(want[:, -1:], axis=-1).astype(mx.int32)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")
def test_compiled_steps_with_the_cuda_kernels_equal_the_runners(fitted_pairs):
    # bf16, the small-M product kernel and the row-invariant attention kernel inside the graph.
    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    lm.model.set_dtype(mx.bfloat16)
    prompt = lm.tokenizer.encode(" ".join(FIT_TEXTS * 4))[:60]
    # (heads of 16: MLX's attention, so close; the demo target's test below asks the bits)
    _side_by_side(target, prompt, 8, lambda got, want: mx.allclose(got, want, rtol=2e-2, atol=2e-2))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")
@pytest.mark.parametrize(
    "cuts", ["", "ATTN_GATE", "NORM_ROPE", "ATTN_GATE,NORM_ROPE", "NORM_MM", "ATTN_GATE,NORM_MM"]
)
def test_compiled_steps_of_the_demo_target_have_the_layer_paths_bits(cuts, monkeypatch):
    # Where plain decoding takes the compiled step by default (CompiledDecode.exact: bf16, the
    # row-invariant attention kernel), each step's logits are the layer path's bit for bit, so
    # DFlash's verify (the layer path) keeps plain decoding's tokens; across a buffer growth;
    # with the attention's output gate in its launch (HF2Q_ATTN_GATE), the q/k norms and RoPE
    # in one launch each (HF2Q_NORM_ROPE) and the layers' norms in their products' launches
    # (HF2Q_NORM_MM), in both paths.
    from hf2q.runtime.pair import load_pair

    for name in filter(None, cuts.split(",")):
        monkeypatch.setenv(getattr(select, f"{name}_ENV"), "1")
    assert "NORM_MM" not in cuts or select.norm_mm_enabled()  # (this MLX's order: not vacuous)
    target = load_pair(None).target
    assert CompiledDecode.exact(target, rows=True)
    prompt = [int(t) for t in mx.random.randint(0, 1000, (250,), key=mx.random.key(3)).tolist()]
    _side_by_side(target, prompt, 24, mx.array_equal)
