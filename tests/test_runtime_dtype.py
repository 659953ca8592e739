"""``--dtype``: which compute dtype ``auto`` picks, and that casting keeps greedy DFlash lossless."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from hf2q import platform
from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.runtime.dflash import dflash_generate, plain_generate, run
from hf2q.runtime.pair import (
    apply_dtype,
    auto_dtype,
    cast_models,
    dflash_cpu_note,
    is_quantized,
    load_pair,
)


@pytest.fixture
def pair(qwen35_dir, drafter_dir):
    return load_pair(str(qwen35_dir), str(drafter_dir))


def _embed_dtype(pair) -> mx.Dtype:
    return pair.target.inner.embed_tokens.weight.dtype


ON_CPU = select.backend() == "cpu"
cpu_only = pytest.mark.skipif(not ON_CPU, reason="auto widens half precision on the CPU only")


@cpu_only
def test_auto_widens_half_precision_weights_on_the_cpu_with_an_optimized_blas(pair):
    cast_models(pair.target, pair.drafter, "bfloat16")
    assert _embed_dtype(pair) == mx.bfloat16
    for blas in ("optimized", "accelerate"):
        assert auto_dtype(pair.target, pair.drafter, blas=blas) == "float32"
    if platform.blas_kind(platform.loaded_blas()) != platform.REFERENCE_BLAS:
        assert apply_dtype(pair.target, pair.drafter, None) == "float32"
        assert _embed_dtype(pair) == mx.float32
        assert pair.drafter.fc.weight.dtype == mx.float32


@cpu_only
def test_auto_keeps_bfloat16_under_the_reference_blas_and_widens_float16(pair):
    # MLX's bf16 products do not use the BLAS: under the reference one they beat float32
    # (DFlash on the demo pair 2x faster), where float16's row products are 3x slower.
    ref = platform.REFERENCE_BLAS
    cast_models(pair.target, pair.drafter, "bfloat16")
    assert auto_dtype(pair.target, pair.drafter, blas=ref) is None
    if platform.blas_kind(platform.loaded_blas()) == ref:  # what `hf2q generate` does here
        assert apply_dtype(pair.target, pair.drafter, None) == "bfloat16"
        assert _embed_dtype(pair) == mx.bfloat16
    cast_models(pair.target, pair.drafter, "float16")
    assert auto_dtype(pair.target, pair.drafter, blas=ref) == "float32"


def test_auto_keeps_float32_models_and_native_keeps_anything(pair):
    assert auto_dtype(pair.target, pair.drafter) is None  # already float32
    cast_models(pair.target, pair.drafter, "bfloat16")
    assert apply_dtype(pair.target, pair.drafter, "native") == "bfloat16"


@pytest.mark.skipif(ON_CPU, reason="GPU backends keep half precision")
def test_auto_keeps_half_precision_weights_on_a_gpu(pair):
    cast_models(pair.target, pair.drafter, "bfloat16")
    assert auto_dtype(pair.target, pair.drafter) is None
    assert apply_dtype(pair.target, pair.drafter, None) == "bfloat16"
    assert _embed_dtype(pair) == mx.bfloat16


@cpu_only
def test_auto_widens_a_quantized_models_scales_and_keeps_its_packing(pair):
    # MLX's CPU quantized products are several times slower with half-precision scales and
    # activations: auto widens the scales, biases and other float weights, never the packing.
    cast_models(pair.target, pair.drafter, "bfloat16")
    nn.quantize(pair.target.model, group_size=32, bits=4)
    q = pair.target.model.language_model.model.layers[0].mlp.down_proj
    packed = q.weight
    assert q.scales.dtype == mx.bfloat16
    for blas in (platform.REFERENCE_BLAS, "optimized"):  # quantized products skip the BLAS
        assert auto_dtype(pair.target, pair.drafter, blas=blas) == "float32"
    assert apply_dtype(pair.target, pair.drafter, None) == "float32"
    assert q.scales.dtype == q.biases.dtype == mx.float32
    assert q.weight.dtype == mx.uint32 and mx.array_equal(q.weight, packed).item()
    prompt = pair.tokenizer.encode("def add(a, b):")[:4]
    d = run(dflash_generate(pair.target, pair.drafter, prompt, max_tokens=16, block_size=8))
    assert d.tokens == run(plain_generate(pair.target, prompt, max_tokens=16)).tokens


def test_auto_leaves_models_that_would_not_fit_in_memory_twice(pair):
    cast_models(pair.target, pair.drafter, "bfloat16")
    auto = auto_dtype(pair.target, pair.drafter, memory_share=1e-12, blas="optimized")
    assert auto is None


def test_a_bad_dtype_names_the_choices(pair):
    with pytest.raises(UsageError, match="auto, native, float32, bfloat16, float16"):
        apply_dtype(pair.target, pair.drafter, "int8")


def test_greedy_dflash_equals_plain_after_widening_a_bfloat16_pair(pair):
    cast_models(pair.target, pair.drafter, "bfloat16")
    apply_dtype(pair.target, pair.drafter, "float32")
    prompt = pair.tokenizer.encode("def add(a, b):")[:4]
    d = run(dflash_generate(pair.target, pair.drafter, prompt, max_tokens=24, block_size=8))
    p = run(plain_generate(pair.target, prompt, max_tokens=24))
    assert d.tokens == p.tokens


def test_dflash_on_a_quantized_target_on_a_cpu_gets_a_note_naming_the_fix(pair, monkeypatch):
    from hf2q.kernels import select

    assert not is_quantized(pair.target.model) and dflash_cpu_note(pair.target) is None
    nn.quantize(pair.target.model, group_size=32, bits=4)
    assert is_quantized(pair.target.model)
    monkeypatch.setattr(select, "backend", lambda: "cpu")
    note = dflash_cpu_note(pair.target)
    assert "slower than plain decoding" in note
    assert "unquantized (bf16) model" in note and "--no-dflash" in note
    monkeypatch.setattr(select, "backend", lambda: "cuda")
    assert dflash_cpu_note(pair.target) is None  # GPUs verify quantized blocks on the kernel
