"""The compiled full-attention layer equals mlx-lm's own layer, step after step, with its KV cache."""

from __future__ import annotations

import checkpoints as ck
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import KVCache

from hf2q.kernels.attention import compile_attention_layer
from hf2q.kernels.gdn import concat_linears


def attention_layer(quantized: bool = False, seed: int = 0):
    args = qwen3_5.TextModelArgs(
        **dict(
            ck.TINY_TEXT_ARGS,
            hidden_size=128,
            intermediate_size=256,
            head_dim=32,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        )
    )
    mx.random.seed(seed)
    model = qwen3_5.TextModel(args)
    if quantized:
        nn.quantize(model, group_size=64, bits=4)
    layer = model.model.layers[3]
    assert not layer.is_linear
    return layer


@pytest.mark.parametrize("fuse_proj", [False, True], ids=["plain", "fused-proj"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "4bit"])
def test_compiled_attention_layer_equals_mlx_lm_over_prefill_decode_and_verify(
    fuse_proj, quantized
):
    layer = attention_layer(quantized)
    run = compile_attention_layer(layer, fuse_proj=fuse_proj)
    ref_cache, cache = KVCache(), KVCache()
    for length, mask in ((5, "causal"), (1, None), (1, None), (4, "causal")):
        x = mx.random.normal((1, length, 128))
        expected = layer(x, mask=mask, cache=ref_cache)
        out = run(x, mask, cache)
        assert mx.allclose(out, expected, rtol=1e-5, atol=1e-5), length
        assert cache.offset == ref_cache.offset
        k_ref, v_ref = ref_cache.keys_and_values()
        k, v = cache.keys_and_values()
        assert mx.allclose(k, k_ref, rtol=1e-5, atol=1e-5)
        assert mx.allclose(v, v_ref, rtol=1e-5, atol=1e-5)


def test_concatenated_linears_compute_the_concatenated_outputs():
    mods = [nn.Linear(32, n, bias=False) for n in (8, 16, 4)]
    x = mx.random.normal((2, 3, 32))
    fused = concat_linears(mods)
    assert mx.allclose(
        fused(x), mx.concatenate([m(x) for m in mods], axis=-1), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="without bias"):
        concat_linears([nn.Linear(8, 4), nn.Linear(8, 4)])
    q = [
        nn.QuantizedLinear(64, 8, bias=False, group_size=64, bits=4),
        nn.QuantizedLinear(64, 8, bias=False, group_size=32, bits=4),
    ]
    with pytest.raises(ValueError, match="different group_size"):
        concat_linears(q)
