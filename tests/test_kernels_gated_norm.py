"""The gated RMS norm in one launch (hf2q/kernels/cuda_norm.py) and where it is used (gdn.py).

On this CPU the kernel's source runs in the CUDA emulator (tests/cuda_emu.py) and is compared bit
for bit with a numpy model of MLX's CUDA order (``rms_norm_small`` then ``precise_swiglu``); the
model itself is checked against mlx-lm's module on the CPU (another summation order: close, not
equal). The CUDA tests compare the launch with mlx-lm's own two kernels on the GPU.
"""

from __future__ import annotations

import math

import cuda_emu
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import assert_switch_keeps_demo_logits, cuda_only
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

from hf2q.errors import UsageError
from hf2q.kernels import cuda_norm as cn
from hf2q.kernels import gdn, select


@pytest.fixture
def emulated(monkeypatch, tmp_path):
    """The launch's own source, run by the CPU emulator in place of MLX's CUDA backend."""
    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")

    def kernel(eps):
        return cuda_emu.EmulatedKernel(
            "hf2q_gated_norm", ["y", "z", "w"], ["out"], cn.source(eps), cn._HEADER, tmp_path
        )

    monkeypatch.setattr(cn, "_kernel", kernel)


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def _model(y: mx.array, z: mx.array, w: mx.array, eps: float) -> np.ndarray:
    """``norm(y, z)`` as MLX's CUDA kernels compute it, in numpy (float32 values of the result):
    ``rms_norm_small`` (:func:`_rms_model`), then ``precise_swiglu``: ``T(g * sigmoid(g) *
    normed)`` in float32 with MLX's sigmoid ``1 / (1 + exp(|g|))``, mirrored for g >= 0."""
    Dv = y.shape[-1]
    normed = _rms_model(_f32(y).reshape(-1, Dv), _f32(w), eps, y.dtype)
    g = _f32(z).reshape(-1, Dv)
    e = np.exp(np.abs(g).astype(np.float64)).astype(np.float32)
    y1 = (np.float32(1) / (np.float32(1) + e)).astype(np.float32)
    sig = np.where(g < 0, y1, np.float32(1) - y1).astype(np.float32)
    out = (g * sig).astype(np.float32) * normed
    return np.array(mx.array(out.astype(np.float32)).astype(y.dtype).astype(mx.float32)).reshape(
        y.shape
    )


def _inputs(rows: int, Dv: int, dtype, seed: int):
    mx.random.seed(seed)
    y = (mx.random.normal((rows, Dv)) * 0.3).astype(dtype)
    z = (mx.random.normal((rows, Dv)) * 2).astype(dtype)
    w = (1 + 0.1 * mx.random.normal((Dv,))).astype(dtype)
    return y, z, w


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows,Dv", [(1, 128), (37, 128), (16, 64), (5, 8), (33, 120), (9, 256)])
def test_emulated_launch_has_the_bits_of_mlx_cuda_order(emulated, rows, Dv, dtype):
    # One row and several blocks' worth, rows not filling a block, rows of fewer lanes (64, 8
    # values), not a power of two (120: the division by D is a true division), the whole warp.
    y, z, w = _inputs(rows, Dv, dtype, rows + Dv)
    out = cn.gated_norm_cuda(y, z, w, 1e-6)
    assert out.shape == y.shape and out.dtype == dtype
    assert np.array_equal(_f32(out), _model(y, z, w, 1e-6))


def test_emulated_launch_keeps_the_leading_axes(emulated):
    # A verify's (B, T, Hv, Dv) in, the same shape out, each row normed on its own.
    y, z, w = _inputs(2 * 3 * 4, 128, mx.bfloat16, 7)
    flat = cn.gated_norm_cuda(y, z, w, 1e-6)
    out = cn.gated_norm_cuda(y.reshape(2, 3, 4, 128), z.reshape(2, 3, 4, 128), w, 1e-6)
    assert out.shape == (2, 3, 4, 128) and mx.array_equal(out.reshape(-1, 128), flat)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_model_is_mlx_lms_gated_norm(dtype):
    # The numpy model is the function mlx-lm computes (the CPU sums in another order: a rounding
    # apart at most, in a few values).
    y, z, w = _inputs(64, 128, dtype, 3)
    norm = Qwen3NextRMSNormGated(128, eps=1e-6)
    norm.weight = w
    want = _f32(norm(y, z))
    got = _model(y, z, w, 1e-6)
    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + 1e-6)
    assert np.mean(got == want) > 0.95


def test_eps_is_the_float32_mlx_passes():
    assert cn._float_literal(1e-6) == float(np.float32(1e-6)).hex() + "f"
    assert float.fromhex(cn._float_literal(1e-5)[:-1]) == float(np.float32(1e-5))
    assert "constexpr float EPS = " + cn._float_literal(1e-6) in cn.source(1e-6)


def test_supported_names_what_the_launch_cannot_take():
    y, z, w = _inputs(4, 128, mx.bfloat16, 1)
    assert cn.supported(y, z, w) is None
    assert "float32" in cn.supported(y.astype(mx.float32), z, w)
    assert "differ" in cn.supported(y, z, w.astype(mx.float32))
    assert "do not match" in cn.supported(y, z[:2], w)
    assert "multiples of 8 up to 256" in cn.supported(*_inputs(4, 512, mx.bfloat16, 1))
    assert "multiples of 8 up to 256" in cn.supported(*_inputs(4, 100, mx.bfloat16, 1))
    with pytest.raises(ValueError, match="cannot take rows of 512 values"):
        cn.gated_norm_cuda(*_inputs(4, 512, mx.bfloat16, 1), 1e-6)


def test_layers_take_the_launch_only_with_the_fused_kernel_and_the_switch(emulated, monkeypatch):
    y, z, w = _inputs(8, 128, mx.bfloat16, 5)
    norm = Qwen3NextRMSNormGated(128, eps=1e-6)
    norm.weight = w
    calls = []
    real = cn.gated_norm_cuda
    monkeypatch.setattr(cn, "gated_norm_cuda", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(select, "backend", lambda: "cuda")  # (CPU: the launch emulated)
    monkeypatch.setenv(select.GATED_NORM_ENV, "0")
    key = select.trace_key()
    assert mx.array_equal(gdn.gated_norm(norm, y, z, "cuda"), norm(y, z)) and calls == []
    monkeypatch.delenv(select.GATED_NORM_ENV)  # on by default (where the fused kernel runs)
    assert select.trace_key() != key  # kept traces are rebuilt with it
    got = gdn.gated_norm(norm, y, z, "cuda")
    assert calls == [(8, 128)] and np.array_equal(_f32(got), _model(y, z, w, 1e-6))
    gdn.gated_norm(norm, y, z, "ops")  # the ops path keeps mlx-lm's module
    gdn.gated_norm(norm, y.astype(mx.float32), z.astype(mx.float32), "cuda")  # (unsupported)
    assert calls == [(8, 128)]
    monkeypatch.setenv(select.GATED_NORM_ENV, "2")
    with pytest.raises(UsageError, match="HF2Q_GATED_NORM"):
        select.gated_norm_enabled()


@cuda_only
@pytest.mark.parametrize("rows", [32, 512, 2048])
def test_cuda_launch_has_the_bits_of_mlx_lms_gated_norm(rows):
    # A decode step's 32 value heads, a 16-token verify's, four slots' (Qwen3.5-4B: Dv 128),
    # and a narrower head: the launch equals mlx-lm's rms_norm + precise_swiglu on the GPU.
    for Dv in (128, 64):
        y, z, w = _inputs(rows, Dv, mx.bfloat16, rows + Dv)
        norm = Qwen3NextRMSNormGated(Dv, eps=1e-6)
        norm.weight = w
        assert mx.array_equal(cn.gated_norm_cuda(y, z, w, 1e-6), norm(y, z)), (rows, Dv)


@cuda_only
def test_cuda_runners_give_the_same_logits_with_the_gated_norm_launch(monkeypatch):
    assert_switch_keeps_demo_logits(monkeypatch, select.GATED_NORM_ENV)


# -- an attention layer's q/k norm and RoPE in one launch ------------------------------------------


@pytest.fixture
def emulated_rope(monkeypatch, tmp_path):
    """The norm + RoPE launch's own source, run by the CPU emulator."""
    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")

    def kernel(eps, base, scale):
        return cuda_emu.EmulatedKernel(
            "hf2q_norm_rope",
            ["x", "w", "off"],
            ["out"],
            cn.rope_source(eps, base, scale),
            cn._HEADER,
            tmp_path,
        )

    monkeypatch.setattr(cn, "_rope_kernel", kernel)


def _libm(name: str):
    """The host C library's float function ``name`` (what the emulator's kernel calls), over an
    array."""
    import ctypes

    fn = getattr(ctypes.CDLL("libm.so.6"), name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return np.vectorize(lambda v: np.float32(fn(float(v))), otypes=[np.float32])


def _rms_model(x: np.ndarray, w: np.ndarray, eps: float, dt) -> np.ndarray:
    """MLX 0.32's CUDA rms_norm_small of 16-bit rows of up to 256 values (x float32 (rows, D) of
    16-bit values): thread i's fused multiply-adds over values 8i.., the warp's tree, one
    rounding of y * r, the weight's product rounded."""
    D = x.shape[-1]

    def r(a):
        return np.array(mx.array(np.asarray(a, np.float32)).astype(dt).astype(mx.float32))

    lanes = np.zeros((x.shape[0], 32), dtype=np.float32)
    for i in range(D // 8):
        acc = np.zeros(x.shape[0], dtype=np.float32)
        for j in range(8):
            t = x[:, 8 * i + j].astype(np.longdouble)
            acc = (t * t + acc.astype(np.longdouble)).astype(np.float32)
        lanes[:, i] = acc
    s = lanes
    for half in (16, 8, 4, 2, 1):
        s = (s[:, :half] + s[:, half : 2 * half]).astype(np.float32)
    rs = (np.float32(1) / np.sqrt(s[:, 0] / np.float32(D) + np.float32(eps))).astype(np.float32)
    return r(w[None, :] * r(x * rs[:, None]))


def _norm_rope_model(x, weight, eps, dims, base, heads, stride, offset) -> np.ndarray:
    """``rope(norm(heads of x))`` as MLX's CUDA kernels compute it (float32 values of the
    16-bit result, (B, heads, L, D)); cos, sin and exp2 from the host's C library."""
    dt = x.dtype
    B, L, _ = x.shape
    D = weight.shape[0]
    xs = np.array(x.astype(mx.float32)).reshape(B, L, heads, stride)[..., :D]
    n = _rms_model(xs.reshape(-1, D), np.array(weight.astype(mx.float32)), eps, dt)
    n = n.reshape(B, L, heads, D).transpose(0, 2, 1, 3)
    half = dims // 2
    i = np.arange(half, dtype=np.float32)
    d = (i / np.float32(half)).astype(np.float32)
    inv = _libm("exp2f")((-d * np.float32(math.log2(float(np.float32(base))))).astype(np.float32))
    off = np.array(offset)
    if off.ndim == 2:  # each row's own position
        pos = off
    else:
        off = off.reshape(-1)
        pos = (off[:, None] if off.size > 1 else off[None, :]) + np.arange(L)[None, :]  # (B|1, L)
    theta = (np.float32(1.0) * pos.astype(np.float32))[..., None] * inv  # (B|1, L, half)
    c, s = _libm("cosf")(theta), _libm("sinf")(theta)
    c, s = c[:, None], s[:, None]  # over heads
    x1, x2 = n[..., :half], n[..., half:dims]
    out = n.copy()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:dims] = x1 * s + x2 * c
    return np.array(mx.array(out.astype(np.float32)).astype(dt).astype(mx.float32))


def _rope_inputs(B, L, heads, stride, D, dtype, seed):
    mx.random.seed(seed)
    x = (mx.random.normal((B, L, heads * stride)) * 2).astype(dtype)
    norm = nn.RMSNorm(D, eps=1e-6)
    norm.weight = (1 + 0.1 * mx.random.normal((D,))).astype(dtype)
    return x, norm


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "B,L,heads,stride,D,dims,offset",
    [
        (1, 3, 4, 512, 256, 64, [1000]),  # the 4B target's queries: gate after each head, 1/4 RoPE
        (2, 2, 2, 256, 256, 64, [5, 300]),  # its keys, two slot rows at their own positions
        (1, 4, 2, 128, 128, 128, [40]),  # the drafter's heads: the whole head rotated
        (2, 1, 3, 64, 64, 32, [7, 0]),  # small heads (half the lanes idle)
    ],
)
def test_emulated_norm_rope_has_the_bits_of_mlx_cuda_order(
    emulated_rope, dtype, B, L, heads, stride, D, dims, offset
):
    x, norm = _rope_inputs(B, L, heads, stride, D, dtype, B + L + D)
    rope = nn.RoPE(dims, base=1e7)
    off = mx.array(offset, dtype=mx.int32)
    assert cn.norm_rope_supported(x, norm, rope, heads, stride) is None
    out = cn.norm_rope_cuda(x, norm, rope, heads, stride, off)
    assert out.shape == (B, heads, L, D) and out.dtype == dtype
    want = _norm_rope_model(x, norm.weight, 1e-6, dims, 1e7, heads, stride, off)
    assert np.array_equal(np.array(out.astype(mx.float32)), want)


def test_emulated_norm_rope_takes_each_rows_own_position(emulated_rope):
    # (B, L) positions, in no order (the drafter graph's context rows, block, padding): each row
    # rotated as a row of its position alone; the wrong shape is refused.
    x, norm = _rope_inputs(2, 5, 2, 128, 128, mx.bfloat16, 4)
    rope = nn.RoPE(128, base=1e6)
    pos = mx.array([[3, 4, 20, 21, 9], [100, 7, 8, 50, 0]], dtype=mx.int32)
    out = cn.norm_rope_cuda(x, norm, rope, 2, 128, pos)
    want = _norm_rope_model(x, norm.weight, 1e-6, 128, 1e6, 2, 128, pos)
    assert np.array_equal(np.array(out.astype(mx.float32)), want)
    row = cn.norm_rope_cuda(x[1:, 3:4], norm, rope, 2, 128, mx.array([50]))
    assert mx.array_equal(row[0, :, 0], out[1, :, 3])
    with pytest.raises(ValueError, match="positions"):
        cn.norm_rope_cuda(x, norm, rope, 2, 128, pos[:, :4])


@pytest.mark.parametrize("dims", [64, 256])
def test_norm_rope_model_is_mlx_lms_norm_then_rope(dims):
    # The model is the function mlx-lm computes (the CPU rounds otherwise: close, not equal).
    B, L, heads, stride, D = 2, 3, 4, 512, 256
    x, norm = _rope_inputs(B, L, heads, stride, D, mx.bfloat16, 9)
    rope = nn.RoPE(dims, base=1e7)
    off = mx.array([100, 7], dtype=mx.int32)
    q = x.reshape(B, L, heads, stride)[..., :D]
    want = np.array(rope(norm(q).transpose(0, 2, 1, 3), offset=off).astype(mx.float32))
    got = _norm_rope_model(x, norm.weight, 1e-6, dims, 1e7, heads, stride, off)
    assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + 2e-2)
    assert np.mean(got == want) > 0.75  # (the CPU's angles round otherwise: 83% equal at 256)


def test_log2_of_the_base_is_the_float_mlx_passes():
    # MLX's launch takes std::log2 of the float32 base; the source bakes log2 rounded once.
    for base in (1e4, 1e5, 1e6, 1e7, 5e5):
        want = _libm("log2f")(np.float32(base))
        assert f"BASE = {float(want).hex()}f" in cn.rope_source(1e-6, base, 1.0)


def test_norm_rope_supported_names_what_it_cannot_take():
    x, norm = _rope_inputs(1, 2, 4, 512, 256, mx.bfloat16, 1)
    rope = nn.RoPE(64, base=1e7)
    assert cn.norm_rope_supported(x, norm, rope, 4, 512) is None
    assert "float32" in cn.norm_rope_supported(x.astype(mx.float32), norm, rope, 4, 512)
    assert "4 heads of 256" in cn.norm_rope_supported(x, norm, rope, 4, 256)
    assert "traditional" in cn.norm_rope_supported(x, norm, nn.RoPE(64, traditional=True), 4, 512)
    assert "rotation of 40" in cn.norm_rope_supported(x, norm, nn.RoPE(40), 4, 512)
    big, bnorm = _rope_inputs(1, 2, 1, 512, 512, mx.bfloat16, 1)
    assert "up to 256" in cn.norm_rope_supported(big, bnorm, rope, 1, 512)
    with pytest.raises(ValueError, match="cannot take heads of 512"):
        cn.norm_rope_cuda(big, bnorm, rope, 1, 512, mx.array([0]))


@cuda_only
@pytest.mark.parametrize(
    "B,L,heads,stride,D,dims,base,offset",
    [
        (1, 16, 16, 512, 256, 64, 1e7, [1000]),  # the 4B target's verify queries
        (1, 16, 4, 256, 256, 64, 1e7, [1000]),  # its keys
        (1, 1, 16, 512, 256, 64, 1e7, [77]),  # a decode step's queries (MLX's one-row kernel)
        (4, 16, 4, 256, 256, 64, 1e7, [10, 300, 5, 1200]),  # four slot rows' keys
        (1, 32, 32, 128, 128, 128, 1e6, [64]),  # a drafter's queries: whole heads rotated
    ],
)
def test_cuda_norm_rope_has_the_bits_of_mlx_norm_then_rope(
    B, L, heads, stride, D, dims, base, offset
):
    x, norm = _rope_inputs(B, L, heads, stride, D, mx.bfloat16, L + D)
    rope = nn.RoPE(dims, base=base)
    off = mx.array(offset, dtype=mx.int32)
    got = cn.norm_rope_cuda(x, norm, rope, heads, stride, off)
    heads_x = x.reshape(B, L, heads, stride)[..., :D]
    want = rope(norm(heads_x).transpose(0, 2, 1, 3), offset=off if B > 1 else off[0])
    assert mx.array_equal(got, want)


@cuda_only
def test_cuda_runners_give_the_same_logits_with_norm_and_rope_in_one_launch(monkeypatch):
    assert_switch_keeps_demo_logits(monkeypatch, select.NORM_ROPE_ENV, rows=True)


def test_kernel_names_carry_the_sources_constants(monkeypatch):
    # MLX 0.32 keeps a process's compiled custom kernels by name: two norms of different eps
    # under one name would both run the first one compiled. Every launch whose source holds
    # constants names them.
    from hf2q.kernels import cuda_matmul as cm

    assert cn.kernel_name("k", 1e-6) != cn.kernel_name("k", 1e-5)
    assert cn.kernel_name("k", 1e-6) == cn.kernel_name("k", float(np.float32(1e-6)))
    assert cn.kernel_name("k", 1e-6, 1e4, 1.0) != cn.kernel_name("k", 1e-6, 1e6, 1.0)
    names = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: names.append(kw["name"]))
    for fn in (cn._kernel, cn._rope_kernel, cm._norm_kernel):
        fn.cache_clear()  # (made again, by the spy; cleared after it too)
    try:
        cn._kernel(1e-6), cn._kernel(1e-5)
        cn._rope_kernel(1e-6, 1e4, 1.0), cn._rope_kernel(1e-6, 1e7, 1.0)
        cm._norm_kernel("single", 1e-6), cm._norm_kernel("single", 1e-5)
    finally:
        for fn in (cn._kernel, cn._rope_kernel, cm._norm_kernel):
            fn.cache_clear()
    assert len(names) == 6 and len(set(names)) == 6
