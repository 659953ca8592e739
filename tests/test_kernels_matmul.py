"""The small-M tensor-core product (hf2q/kernels/cuda_matmul.py) and its dispatch (linear.py).

On this CPU the kernel source runs in the CUDA emulator (tests/cuda_emu.py), whose warp-level
``mma`` follows the PTX ISA's fragment layout: that checks the kernel's indexing (which lane loads
which weights and inputs, the k permutation, the cross-warp sum, the stores) against a float32
product. The CUDA tests run the real kernel.
"""

from __future__ import annotations

import cuda_emu
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.qwen3 import MLP

from hf2q.errors import UsageError
from hf2q.kernels import cuda_matmul as cm
from hf2q.kernels import linear as lin
from hf2q.kernels import select

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


@pytest.fixture
def emulated(monkeypatch, tmp_path):
    """The kernel's own source, run by the CPU emulator in place of MLX's CUDA backend."""
    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")
    kern = cuda_emu.EmulatedKernel(
        "hf2q_small_mm", ["x", "w"], ["y"], cm._SOURCE, cm._HEADER, workdir=tmp_path
    )
    monkeypatch.setattr(cm, "_kernel", lambda: kern)
    return kern


def _inputs(rows, K, N, dtype, seed=0):
    mx.random.seed(seed)
    x = mx.random.normal((rows, K)).astype(dtype)
    w = (mx.random.normal((N, K)) * K**-0.5).astype(dtype)
    return x, w


def _product(x, w):
    """float64 product of the (rounded) inputs."""
    xf = np.array(x.astype(mx.float32), dtype=np.float64)
    wf = np.array(w.astype(mx.float32), dtype=np.float64)
    return xf @ wf.T


def _assert_rounded_product(y, x, w):
    """y is the product rounded once to its dtype (float32 summation error far below that)."""
    ref = _product(x, w)
    got = np.array(y.astype(mx.float32), dtype=np.float64)
    ulp = 2.0**-8 if y.dtype == mx.bfloat16 else 2.0**-11
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= ulp * np.abs(ref) + 1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 16, 19, 40])
def test_emulated_kernel_computes_the_product(emulated, rows, dtype):
    x, w = _inputs(rows, 256, 48, dtype)
    y = cm.small_matmul_cuda(x, w)
    assert y.dtype == dtype and y.shape == (rows, 48)
    _assert_rounded_product(y, x, w)


@pytest.mark.parametrize("tune", [(1, 1, 1), (2, 4, 2), (4, 2, 4)])
def test_emulated_kernel_every_launch_shape(emulated, tune):
    x, w = _inputs(17, 512, 64, mx.bfloat16, seed=1)
    _assert_rounded_product(cm.small_matmul_cuda(x, w, tune=tune), x, w)


def test_emulated_kernel_rows_are_independent_of_the_batch(emulated):
    x, w = _inputs(16, 256, 32, mx.bfloat16, seed=2)
    batch = cm.small_matmul_cuda(x, w)
    for i in (0, 7, 15):
        assert mx.array_equal(cm.small_matmul_cuda(x[i : i + 1], w)[0], batch[i])


def test_emulated_kernel_keeps_leading_axes(emulated):
    x, w = _inputs(6, 128, 16, mx.bfloat16, seed=3)
    y = cm.small_matmul_cuda(x.reshape(2, 3, 128), w)
    assert y.shape == (2, 3, 16)
    assert mx.array_equal(y.reshape(6, 16), cm.small_matmul_cuda(x, w))


def test_supported_names_what_it_cannot_do():
    x, w = _inputs(4, 128, 16, mx.bfloat16)
    assert cm.supported(x, w) is None
    assert "bf16 or fp16" in cm.supported(x.astype(mx.float32), w.astype(mx.float32))
    assert "multiple of 64" in cm.supported(x[:, :96], w[:, :96])
    assert "multiple of 64" in cm.supported(x[:, :0], w[:, :0])
    assert "multiple of 8" in cm.supported(x, w[:12])
    big = mx.zeros((cm.MAX_ROWS + 1, 128), dtype=mx.bfloat16)
    assert f"1 to {cm.MAX_ROWS}" in cm.supported(big, w)


def test_fits_keeps_many_rows_of_large_weights_on_cublas():
    w_small = mx.zeros((256, 256), dtype=mx.bfloat16)
    w_large = mx.zeros((4096, 2048), dtype=mx.bfloat16)  # 8M elements > SMALL_WEIGHT
    for rows, w, want in [(32, w_large, True), (33, w_large, False), (128, w_small, True)]:
        assert lin.fits(mx.zeros((rows, w.shape[1]), dtype=mx.bfloat16), w) is want


def test_linear_dispatch(emulated, monkeypatch):
    x, _ = _inputs(5, 128, 32, mx.bfloat16, seed=4)
    mod = nn.Linear(128, 32, bias=True)
    mod.set_dtype(mx.bfloat16)
    calls = []
    real = cm.small_matmul_cuda

    def counting(x, w, **kw):
        calls.append(x.shape)
        return real(x, w, **kw)

    monkeypatch.setattr(cm, "small_matmul_cuda", counting)
    assert mx.array_equal(lin.linear(mod, x, False), mod(x)) and not calls
    y = lin.linear(mod, x, True)
    assert calls == [(5, 128)]
    assert mx.allclose(y.astype(mx.float32), mod(x).astype(mx.float32), rtol=2e-2, atol=2e-2)
    # Not for the kernel: quantized layers, float32, too many rows of a large weight.
    q = nn.QuantizedLinear.from_linear(nn.Linear(128, 32, bias=False), group_size=64, bits=4)
    assert mx.array_equal(lin.linear(q, x, True), q(x))
    x32 = x.astype(mx.float32)
    mod32 = nn.Linear(128, 32, bias=False)
    assert mx.array_equal(lin.linear(mod32, x32, True), mod32(x32))
    assert len(calls) == 1
    mlp = MLP(128, 192)
    mlp.set_dtype(mx.bfloat16)
    y = lin.swiglu_mlp(mlp, x, True)
    assert len(calls) == 4
    assert mx.allclose(y.astype(mx.float32), mlp(x).astype(mx.float32), rtol=5e-2, atol=5e-2)
    # Not a dense SwiGLU MLP of mlx-lm's (e.g. the sparse MoE block): its own call, untouched.
    other = nn.Sequential(nn.Linear(128, 128))
    other.set_dtype(mx.bfloat16)
    assert mx.array_equal(lin.swiglu_mlp(other, x, True), other(x)) and len(calls) == 4


def test_small_mm_switch_is_cuda_only_and_reported(monkeypatch):
    monkeypatch.setenv(select.SMALL_MM_ENV, "1")
    info = select.describe()
    assert "small products" in select.summary()
    if select.backend() == "cuda":
        assert select.small_mm_enabled() and "tensor-core kernel" in info["small_mm"]
        monkeypatch.setenv(select.SMALL_MM_ENV, "0")
        assert not select.small_mm_enabled()
        monkeypatch.setenv(select.SMALL_MM_ENV, "maybe")
        with pytest.raises(UsageError, match="HF2Q_SMALL_MM"):
            select.small_mm_enabled()
    else:
        assert not select.small_mm_enabled() and info["small_mm"] == "MLX matmul"


# -- on the GPU ------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K,N", [(256, 768), (2560, 9216), (9216, 2560), (1024, 248)])
@pytest.mark.parametrize("rows", [1, 16, 32, 128])
def test_cuda_kernel_computes_the_product(rows, K, N, dtype):
    x, w = _inputs(rows, K, N, dtype)
    if cm.supported(x, w) is not None:
        pytest.skip(cm.supported(x, w))
    _assert_rounded_product(cm.small_matmul_cuda(x, w), x, w)


@cuda_only
def test_cuda_kernel_rows_are_bit_equal_whatever_the_batch():
    x, w = _inputs(128, 2560, 1024, mx.bfloat16, seed=5)
    full = cm.small_matmul_cuda(x, w)
    for n in (1, 16, 32):
        part = cm.small_matmul_cuda(x[:n], w)
        assert mx.array_equal(part, full[:n])


@pytest.fixture(scope="module")
def demo_pair():
    from hf2q.runtime.pair import load_pair

    return load_pair(None)


@cuda_only
def test_cuda_demo_target_through_the_kernel_matches_mlx(demo_pair):
    from hf2q.kernels.layers import fast_layer_fn

    target = demo_pair.target
    assert target.dtype == mx.bfloat16
    tokens = mx.array([demo_pair.tokenizer.encode("def fibonacci(n):\n    return")])
    outs = {}
    for mm in (False, True):
        logits, _ = target.forward(tokens, target.make_cache(), layer_fn=fast_layer_fn(mm=mm))
        outs[mm] = logits.astype(mx.float32)
    scale = mx.abs(outs[False]).max()
    assert (mx.abs(outs[True] - outs[False]).max() / scale).item() < 5e-2


@pytest.mark.parametrize("fixture", ["qwen35_dir", "qwen35_moe_dir"])
def test_runners_with_the_dispatch_leave_what_it_cannot_run_alone(fixture, request):
    # float32 (the kernel's no) and the sparse MoE block (not a dense SwiGLU MLP): with the
    # dispatch on, the compiled runners compute exactly what they compute without it.
    from hf2q.kernels.layers import fast_layer_fn
    from hf2q.loading import load_model
    from hf2q.runtime.target import TargetModel

    target = TargetModel(load_model(request.getfixturevalue(fixture)).model)
    tokens = mx.array([[1, 5, 9, 13, 2, 7]])
    outs = [
        target.forward(tokens, target.make_cache(), layer_fn=fast_layer_fn(mm=mm), mm=mm)[0]
        for mm in (False, True)
    ]
    assert mx.array_equal(outs[0], outs[1])
