"""Gated-DeltaNet layers as pure functions: equal to mlx-lm's own layer, exact rollback, mx.compile.

Runs on the CPU (the ``ops`` and ``mlx`` implementations); the CUDA implementations are checked
in ``test_kernels_gated_delta.py``. Models are mlx-lm's own Qwen3.5 classes with random weights.
"""

from __future__ import annotations

import checkpoints as ck
import mlx.core as mx
import pytest
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache

from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.kernels.gdn import (
    compile_gdn_decoder_layer,
    compile_post_attention,
    empty_states,
    gdn_decoder_layer,
    gdn_mixer,
    rollback,
)


def tiny_model(dtype=mx.float32, seed=0) -> qwen3_5.TextModel:
    args = qwen3_5.TextModelArgs(**ck.TINY_TEXT_ARGS)
    mx.random.seed(seed)
    model = qwen3_5.TextModel(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    return model


def filled_cache(layer, batch: int, seed: int) -> ArraysCache:
    """A linear-attention cache as mlx-lm leaves it after some tokens (random contents)."""
    mx.random.seed(seed)
    attn = layer.linear_attn
    cache = ArraysCache(size=2)
    cache[0] = mx.random.normal((batch, attn.conv_kernel_size - 1, attn.conv_dim)) * 0.5
    cache[1] = mx.random.normal((batch, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.1
    return cache


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("record", ["states", "final"])
def test_layer_function_equals_mlx_lm_layer_and_its_cache(batch, record):
    model = tiny_model()
    layer = model.model.layers[0]
    cache = filled_cache(layer, batch, seed=1)
    conv0, state0 = cache[0], cache[1]
    x = mx.random.normal((batch, 6, 64))
    expected = layer(x, None, cache)
    out, rec = gdn_decoder_layer(layer, x, conv0, state0, impl="ops", record=record)
    assert mx.allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert mx.allclose(rec.final_state, cache[1], rtol=1e-5, atol=1e-6)
    assert mx.array_equal(rec.final_conv_state, cache[0])


def test_empty_states_equal_mlx_lm_fresh_cache():
    model = tiny_model(seed=2)
    layer = model.model.layers[1]
    x = mx.random.normal((1, 4, 64))
    cache = ArraysCache(size=2)
    expected = layer(x, None, cache)
    out, rec = gdn_decoder_layer(layer, x, None, None, impl="ops")
    assert mx.allclose(out, expected, rtol=1e-5, atol=1e-6)
    conv0, state0 = empty_states(layer.linear_attn, 1, mx.float32)
    out2, _ = gdn_decoder_layer(layer, x, conv0, state0, impl="ops")
    assert mx.array_equal(out, out2)


@pytest.mark.parametrize("impl,record", [("ops", "states"), ("ops", "final"), ("mlx", "final")])
def test_rollback_equals_running_only_the_kept_tokens(impl, record):
    model = tiny_model(seed=3)
    layer = model.model.layers[0]
    T = 7
    x = mx.random.normal((1, T, 64))
    start = filled_cache(layer, 1, seed=4)
    _, rec = gdn_decoder_layer(layer, x, start[0], start[1], impl=impl, record=record)
    for n in (1, 4, T):
        kept = ArraysCache(size=2)
        kept[0], kept[1] = start[0], start[1]
        layer(x[:, :n], None, kept)
        conv_n, state_n = rollback(layer.linear_attn, rec, n, impl=impl)
        # Bit-equal on the CPU; a GPU may pick a different GEMM for n rows than for T rows.
        if mx.default_device() == mx.cpu:
            assert mx.array_equal(conv_n, kept[0])
        else:
            assert mx.allclose(conv_n, kept[0], rtol=1e-6, atol=1e-7)
        assert mx.allclose(state_n, kept[1], rtol=1e-5, atol=1e-7)


def test_rollback_refuses_counts_outside_the_block():
    model = tiny_model(seed=5)
    layer = model.model.layers[0]
    _, rec = gdn_decoder_layer(layer, mx.random.normal((1, 3, 64)), None, None)
    with pytest.raises(ValueError, match="1..3"):
        rollback(layer.linear_attn, rec, 0)
    with pytest.raises(ValueError, match="1..3"):
        rollback(layer.linear_attn, rec, 4)


def test_record_gives_the_conv_rows_before_each_cut():
    from hf2q.kernels.gdn import GdnRecord

    conv_input = mx.concatenate(
        [mx.arange(6).reshape(1, 3, 2), mx.arange(100, 108).reshape(1, 4, 2)], axis=1
    )
    rec = GdnRecord(conv_input, mx.zeros((1, 4, 1)), mx.zeros((1, 4, 1)), None, None, "final")
    # rows: c0 c1 c2 q0 q1 q2 q3; keeping 2 tokens leaves rows c2 q0 q1
    assert rec.kept_rows == 3 and rec.steps == 4
    assert rec.conv_state_after(2).tolist() == [[[4, 5], [100, 101], [102, 103]]]
    assert rec.final_conv_state.tolist() == [[[102, 103], [104, 105], [106, 107]]]
    assert rec.qkv.tolist() == mx.arange(100, 108).reshape(1, 4, 2).tolist()


@pytest.mark.parametrize("impl,record", [("ops", "states"), ("ops", "final"), ("mlx", "final")])
@pytest.mark.parametrize("T", [1, 5])
def test_compiled_layer_equals_the_uncompiled_layer(impl, record, T):
    model = tiny_model(seed=6)
    layer = model.model.layers[2]
    start = filled_cache(layer, 1, seed=7)
    run = compile_gdn_decoder_layer(layer, impl=impl, record=record)
    for step in range(2):  # the second call reuses the trace
        x = mx.random.normal((1, T, 64))
        out, rec = gdn_decoder_layer(layer, x, start[0], start[1], impl=impl, record=record)
        out_c, rec_c = run(x, start[0], start[1])
        assert mx.allclose(out_c, out, rtol=1e-5, atol=1e-6), step
        assert mx.allclose(rec_c.rec, rec.rec, rtol=1e-5, atol=1e-7)
        assert mx.allclose(rec_c.qkv, rec.qkv, rtol=1e-5, atol=1e-6)


def test_compiled_post_attention_equals_the_layer_tail():
    model = tiny_model(seed=8)
    layer = model.model.layers[3]  # full attention
    assert not layer.is_linear
    x = mx.random.normal((1, 5, 64))
    cache_a, cache_b = KVCache(), KVCache()
    expected = layer(x, "causal", cache_a)
    r = layer.self_attn(layer.input_layernorm(x), "causal", cache_b)
    out = compile_post_attention(layer)(x, r)
    assert mx.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_mixer_in_bfloat16_keeps_the_model_dtype_and_a_float32_state():
    model = tiny_model(dtype=mx.bfloat16, seed=9)
    attn = model.model.layers[0].linear_attn
    x = mx.random.normal((1, 3, 64)).astype(mx.bfloat16)
    out, rec = gdn_mixer(attn, x, None, None, impl="ops")
    assert out.dtype == mx.bfloat16
    assert rec.rec.dtype == mx.float32 and rec.qkv.dtype == mx.bfloat16


@pytest.fixture
def on_cpu():
    """Make the CPU MLX's default device for one test (restored afterwards, also on a GPU box)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


def test_selection_on_the_cpu_uses_ops_and_reports_it(monkeypatch, on_cpu):
    monkeypatch.delenv(select.ENV, raising=False)
    model = tiny_model(seed=10)
    attn = model.model.layers[0].linear_attn
    info = select.describe(attn)
    assert info["backend"] == "cpu"
    assert info["gdn_mixer"] == "ops (portable)"
    assert info["gdn_record"] == "states"
    assert info["recurrence"] == "ops"
    assert select.gdn_impl(attn) == "ops"


def test_forcing_cuda_where_there_is_none_names_the_fix(monkeypatch, on_cpu):
    model = tiny_model(seed=11)
    attn = model.model.layers[0].linear_attn
    monkeypatch.setenv(select.ENV, "cuda")
    with pytest.raises(UsageError, match="unset HF2Q_KERNELS"):
        select.gdn_impl(attn)
    monkeypatch.setenv(select.ENV, "fast")
    with pytest.raises(UsageError, match="not one of auto, ops, cuda"):
        select.kernel_mode()


def test_dispatching_gated_delta_steps_on_the_cpu_returns_per_step_states(monkeypatch, on_cpu):
    monkeypatch.delenv(select.ENV, raising=False)
    mx.random.seed(12)
    q = mx.random.normal((1, 4, 2, 16)) * 0.25
    k = mx.random.normal((1, 4, 2, 16)) * 0.25
    v = mx.random.normal((1, 4, 4, 16))
    g = mx.random.uniform(0.5, 1.0, (1, 4, 4))
    beta = mx.random.uniform(0.0, 1.0, (1, 4, 4))
    s0 = mx.zeros((1, 4, 16, 16))
    y, states = select.gated_delta_steps(q, k, v, g, beta, s0)
    assert y.shape == (1, 4, 4, 16) and states.shape == (1, 4, 4, 16, 16)
    assert not mx.array_equal(states[:, 0], states[:, 3])


@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "4bit"])
def test_fused_projections_give_the_same_layer_output_and_record(quantized):
    import mlx.nn as nn

    from hf2q.kernels.gdn import fuse_projections

    model = tiny_model(seed=13)
    if quantized:
        # groups of 32: MLX's CUDA product of rows that are one group is wrong (hidden 64)
        nn.quantize(model, group_size=32, bits=4)
    layer = model.model.layers[0]
    start = filled_cache(layer, 1, seed=14)
    x = mx.random.normal((1, 4, 64))
    out, rec = gdn_decoder_layer(layer, x, start[0], start[1], impl="ops", record="states")
    fused = fuse_projections(layer)
    out_f, rec_f = gdn_decoder_layer(
        layer, x, start[0], start[1], impl="ops", record="states", fused=fused
    )
    assert mx.allclose(out_f, out, rtol=1e-5, atol=1e-6)
    assert mx.allclose(rec_f.rec, rec.rec, rtol=1e-5, atol=1e-7)
    run = compile_gdn_decoder_layer(layer, impl="ops", record="states", fused=fused)
    out_c, _ = run(x, start[0], start[1])
    assert mx.allclose(out_c, out, rtol=1e-5, atol=1e-6)


def test_conv_weight_is_the_reshaped_weight_kept_until_it_is_replaced():
    # The fused kernel reads the depthwise conv weight as (C, K); made once and kept, so no
    # forward reshapes it again (a graph node a layer), and a new weight is seen at once.
    from hf2q.kernels.gdn import conv_weight

    attn = next(layer for layer in tiny_model().layers if layer.is_linear).linear_attn
    w = conv_weight(attn)
    C, K, _ = attn.conv1d.weight.shape
    assert w.shape == (C, K) and mx.array_equal(w, attn.conv1d.weight.reshape(C, K)).item()
    assert conv_weight(attn) is w
    attn.conv1d.weight = attn.conv1d.weight * 3
    assert mx.array_equal(conv_weight(attn), attn.conv1d.weight.reshape(C, K)).item()
    assert set(attn.conv1d.parameters()) <= {"weight", "bias"}  # kept, not a parameter
