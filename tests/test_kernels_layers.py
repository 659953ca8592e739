"""The fast layer function: a whole target forward through compiled runners equals mlx-lm's own."""

from __future__ import annotations

import gc
import weakref

import checkpoints as ck
import mlx.core as mx
import pytest
from mlx_lm.models import qwen3, qwen3_5
from mlx_lm.models.cache import make_prompt_cache

from hf2q.kernels import layers
from hf2q.runtime.target import TargetModel

TEXT = ck.TINY_TEXT_ARGS


def qwen35(moe: bool = False, seed: int = 0) -> TargetModel:
    args = dict(TEXT)
    if moe:
        args.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    mx.random.seed(seed)
    return TargetModel(qwen3_5.TextModel(qwen3_5.TextModelArgs(**args)))


def qwen3_plain(seed: int = 0) -> TargetModel:
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=64,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    return TargetModel(qwen3.Model(args))


def run_both(target: TargetModel, fuse_proj: bool) -> None:
    """Prefill 6 tokens then decode 3, once with each layer's own call and once with the fast one."""
    prompt = mx.array([[3, 14, 15, 9, 2, 6]])
    ref_cache, cache = make_prompt_cache(target.model), make_prompt_cache(target.model)
    fast = layers.fast_layer_fn(fuse_proj=fuse_proj)
    ref, _ = target.forward(prompt, ref_cache)
    out, _ = target.forward(prompt, cache, layer_fn=fast)
    assert mx.allclose(out, ref, rtol=1e-5, atol=1e-5)
    tok = mx.argmax(ref[:, -1:], axis=-1)
    for _ in range(3):
        ref, _ = target.forward(tok, ref_cache)
        out, _ = target.forward(tok, cache, layer_fn=fast)
        assert mx.allclose(out, ref, rtol=1e-5, atol=1e-5)
        tok = mx.argmax(ref[:, -1:], axis=-1)
    for c_ref, c in zip(ref_cache, cache):
        for a, b in zip(c_ref.state, c.state):
            if isinstance(a, mx.array):
                assert mx.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fuse_proj", [False, True], ids=["plain", "fused-proj"])
def test_fast_layer_function_equals_mlx_lm_forward_on_qwen35(fuse_proj):
    run_both(qwen35(seed=1), fuse_proj)


def test_fast_layer_function_equals_mlx_lm_forward_on_qwen35_moe():
    run_both(qwen35(moe=True, seed=2), fuse_proj=True)


def test_fast_layer_function_leaves_other_architectures_to_their_own_layers():
    run_both(qwen3_plain(seed=3), fuse_proj=True)


def test_runners_are_built_once_per_layer_and_dropped_with_it():
    target = qwen35(seed=4)
    layer = target.layers[0]
    first = layers.gdn_layer_runner(layer, impl="ops", record="final")
    assert layers.gdn_layer_runner(layer, impl="ops", record="final") is first
    assert layers.gdn_layer_runner(layer, impl="ops", record="states") is not first
    key = (id(layer), "gdn", "ops", "final", False, True, False, None, None)
    assert key in layers._RUNNERS
    del layer, first, target
    gc.collect()
    assert key not in layers._RUNNERS


def test_layer_choices_are_made_once_and_dropped_with_the_layer():
    target = qwen35(seed=7)
    layer, made = target.layers[0], []
    chosen = layers.Chosen()
    first = chosen.get(layer, lambda lay: made.append(lay) or object())
    assert chosen.get(layer, lambda lay: made.append(lay) or object()) is first
    assert len(made) == 1 and len(chosen) == 1
    # The verify's layer functions live as long as the process: they must not keep a model's
    # compiled runners (whose traces hold its weights) once the model is gone.
    fn = layers.fast_layer_fn()
    cache = make_prompt_cache(target.model)
    target.forward(mx.array([[3, 1, 4]]), cache, layer_fn=fn)
    runner = weakref.ref(layers.gdn_layer_runner(layer, impl="ops", record="final"))
    assert runner() is not None
    made.clear()  # it holds the layer
    del layer, first, target, cache
    gc.collect()
    assert len(chosen) == 0
    assert runner() is None  # fn is still alive


def test_long_prompts_on_ops_run_the_layers_own_call():
    # 70 tokens > MAX_OPS_STEPS: the Gated-DeltaNet layers fall back to mlx-lm's call (same result).
    target = qwen35(seed=5)
    prompt = mx.array([[i % 60 + 1 for i in range(layers.MAX_OPS_STEPS + 6)]])
    ref_cache, cache = make_prompt_cache(target.model), make_prompt_cache(target.model)
    ref, _ = target.forward(prompt, ref_cache)
    out, _ = target.forward(prompt, cache, layer_fn=layers.fast_layer_fn())
    assert mx.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_compile_can_be_turned_off_with_the_same_results(monkeypatch):
    monkeypatch.setenv("HF2Q_COMPILE", "0")
    run_both(qwen35(seed=6), fuse_proj=False)
    monkeypatch.setenv("HF2Q_COMPILE", "maybe")
    from hf2q.errors import UsageError

    with pytest.raises(UsageError, match="HF2Q_COMPILE"):
        layers.select.compile_enabled()
