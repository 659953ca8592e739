"""Products whose input rows are RMS-normed in the launch (hf2q/kernels/cuda_matmul.py ``norm=``).

A decoder layer's ``input_layernorm`` and ``post_attention_layernorm`` are each one graph node
before the products that read them; the normed launches take the un-normed rows and the norm's
weight and multiply the values MLX's ``rms_norm_small`` would have written. On this CPU the
launches run in the CUDA emulator (tests/cuda_emu.py) and must give the bits of the plain launch
(emulated too) of a numpy model of MLX's norm, which is checked against ``mx.fast.rms_norm``;
the CUDA tests compare with MLX's own norm kernel followed by the plain launch.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import cuda_only

from hf2q.kernels import cuda_matmul as cm


@pytest.fixture
def emulated(emulated_products):
    """The plain and the normed launches' own sources, run by the CPU emulator (conftest)."""
    return emulated_products


def _f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def norm_shape(K: int) -> tuple[int, int]:
    """(threads a row, vectors of 8 values a thread) of MLX 0.32.4's CUDA ``rms_norm_small`` for
    16-bit rows of K values (up to 8192; its dispatch on K)."""
    nvec = -(-K // 8)
    if K <= 512:
        return 64, 1
    if nvec % 128 == 0 and nvec // 128 <= 8:
        return 128, nvec // 128
    if nvec % 64 == 0 and nvec // 64 <= 8:
        return 64, nvec // 64
    return 128, -(-nvec // 128)


def rms_model(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """MLX 0.32.4's CUDA ``rms_norm_small`` of 16-bit rows of up to 8192 values, in numpy: a
    block of BS threads a row (:func:`norm_shape`), thread t squaring and adding in turn (fused
    multiply-adds) the 8 values of its vectors t, BS + t, ... (zeros past the row), each warp
    adding its threads' sums by the tree lane + 16, + 8, + 4, + 2, + 1, then the warps' sums (at
    lanes 0 .., zeros past them) by the same tree; r = rsqrt(sum / K + eps) (here 1 / sqrt,
    correctly rounded, where the GPU's rsqrtf may differ: the CUDA tests compare with MLX's
    kernel), and each value ``T(w * T(x * r))``. Returns an array of x's dtype."""
    dt = x.dtype
    xs = _f32(x).reshape(-1, x.shape[-1])
    rows, K = xs.shape
    bs, ch = norm_shape(K)

    def r(a):
        return np.array(mx.array(np.asarray(a, np.float32)).astype(dt).astype(mx.float32))

    def tree(s):
        for half in (16, 8, 4, 2, 1):
            s = (s[:, :half] + s[:, half : 2 * half]).astype(np.float32)
        return s[:, 0]

    padded = np.zeros((rows, bs * ch * 8), dtype=np.float32)
    padded[:, :K] = xs
    vec = padded.reshape(rows, ch, bs, 8)  # [row, chunk i, thread t, value j]: vector i bs + t
    threads = np.zeros((rows, bs), dtype=np.float32)
    for i in range(ch):
        for j in range(8):
            t = vec[:, i, :, j].astype(np.longdouble)
            threads = (t * t + threads.astype(np.longdouble)).astype(np.float32)
    warps = np.zeros((rows, 32), dtype=np.float32)
    for k in range(bs // 32):
        warps[:, k] = tree(threads[:, 32 * k : 32 * k + 32])
    total = tree(warps)
    rs = (np.float32(1) / np.sqrt(total / np.float32(K) + np.float32(eps))).astype(np.float32)
    out = r(_f32(w)[None, :] * r(xs * rs[:, None]))
    return mx.array(out).astype(dt).reshape(x.shape)


def test_model_has_the_bits_mlx_gave_on_an_h100():
    # A 4B-shaped target's row (2560 values, weight 1) whose norm MLX 0.32.4 computed on an H100
    # (session 60, benchmarks/norm_mm_check.py): a model summing in another order (each thread
    # eight consecutive values, ten warps) put r one float32 step lower there, and 12 of the
    # row's values a rounding apart.
    data = np.load(Path(__file__).parent / "fixtures" / "norm_row_h100.npz")
    x = mx.array(data["x"]).astype(mx.bfloat16)
    got = _f32(rms_model(x, mx.ones((2560,), dtype=mx.bfloat16), 1e-6))
    assert np.array_equal(got, data["mlx"])
    assert (
        norm_shape(2560) == (64, 5) and norm_shape(256) == (64, 1) and norm_shape(4096) == (128, 4)
    )


def _inputs(rows, K, widths, dtype, seed):
    mx.random.seed(seed)
    x = (mx.random.normal((rows, K)) * 3).astype(dtype)
    nw = (1 + 0.2 * mx.random.normal((K,))).astype(dtype)
    ws = [(mx.random.normal((n, K)) * K**-0.5).astype(dtype) for n in widths]
    return x, nw, ws


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K", [64, 256, 640, 2560, 8192])
def test_model_is_mlx_rms_norm(K, dtype):
    # The model computes mlx's function (the CPU sums in another order: x * r may round the
    # other way, and then the weight's product too: two roundings apart at most, in few values).
    x, nw, _ = _inputs(5, K, [], dtype, K)
    want = _f32(mx.fast.rms_norm(x, nw, 1e-6))
    got = _f32(rms_model(x, nw, 1e-6))
    ulp = 2.0**-6 if dtype == mx.bfloat16 else 2.0**-9
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + 1e-6)
    assert np.mean(got == want) > 0.95


@pytest.mark.parametrize(
    "rows,K,N,dtype",
    [
        (1, 2560, 64, mx.bfloat16),  # the 4B's hidden size: 64 threads of five vectors
        (16, 640, 96, mx.bfloat16),  # a verify's block; 128 threads, the last 48 on zeros
        (3, 256, 32, mx.float16),  # 64 threads, one warp on zeros
        (7, 128, 48, mx.bfloat16),  # 16 threads with values
        (20, 512, 64, mx.bfloat16),  # two m-tiles; 64 threads of one vector
        (2, 4096, 32, mx.bfloat16),  # 128 threads of four vectors
        (3, 1536, 32, mx.float16),  # 64 threads of three vectors
    ],
)
def test_emulated_normed_launch_has_the_bits_of_the_norm_then_the_product(
    rows, K, N, dtype, emulated
):
    x, nw, (w,) = _inputs(rows, K, [N], dtype, rows + K)
    y = cm.small_matmul_cuda(x, w, norm=(nw, 1e-6))
    assert y.shape == (rows, N) and y.dtype == dtype
    assert mx.array_equal(y, cm.small_matmul_cuda(rms_model(x, nw, 1e-6), w))


def test_emulated_normed_launch_reads_its_eps(emulated):
    # A large eps changes the norm: the launch's constant is the one asked for.
    x, nw, (w,) = _inputs(4, 256, [32], mx.bfloat16, 9)
    x = x * 0.01
    for eps in (1e-6, 1e-2):
        want = cm.small_matmul_cuda(rms_model(x, nw, eps), w)
        assert mx.array_equal(cm.small_matmul_cuda(x, w, norm=(nw, eps)), want)
    assert not mx.array_equal(
        cm.small_matmul_cuda(x, w, norm=(nw, 1e-6)), cm.small_matmul_cuda(x, w, norm=(nw, 1e-2))
    )


@pytest.mark.parametrize("rows,widths", [(1, (64, 32, 16, 8)), (16, (96, 32)), (5, (64, 64, 32))])
def test_emulated_normed_grouped_launch_has_each_products_bits(rows, widths, emulated):
    x, nw, ws = _inputs(rows, 512, widths, mx.bfloat16, rows)
    ys = cm.grouped_matmul_cuda(x, ws, norm=(nw, 1e-6))
    xn = rms_model(x, nw, 1e-6)
    for y, want in zip(ys, cm.grouped_matmul_cuda(xn, ws), strict=True):
        assert mx.array_equal(y, want)


@pytest.mark.parametrize("B,P,L", [(1, 16, 16), (2, 16, 8), (1, 3, 5)])
def test_emulated_joined_launch_has_the_bits_of_the_concatenated_rows(B, P, L, emulated):
    # A drafter layer's k and v products: context rows as they come, then the block's rows
    # through the input norm, without the concatenation: each output row the grouped launch's
    # of the joined (normed) rows.
    mx.random.seed(B + P + L)
    c = (mx.random.normal((B, P, 256)) * 2).astype(mx.bfloat16)
    x, nw, ws = _inputs(B * L, 256, [64, 32], mx.bfloat16, P)
    x = x.reshape(B, L, 256)
    assert cm.joined_supported(c, x, ws) is None
    got = cm.joined_matmul_cuda(c, x, ws, norm=(nw, 1e-6))
    rows = mx.concatenate([c, rms_model(x, nw, 1e-6)], axis=1)
    for y, want in zip(got, cm.grouped_matmul_cuda(rows, ws), strict=True):
        assert y.shape == (B, P + L, want.shape[-1]) and mx.array_equal(y, want)


def test_joined_supported_names_what_the_launch_cannot_take():
    c = mx.zeros((1, 16, 256), dtype=mx.bfloat16)
    x = mx.zeros((1, 16, 256), dtype=mx.bfloat16)
    ws = [mx.zeros((64, 256), dtype=mx.bfloat16)] * 2
    assert cm.joined_supported(c, x, ws) is None
    assert "(B, P, K)" in cm.joined_supported(c[0], x, ws)
    assert "(B, P, K)" in cm.joined_supported(mx.zeros((2, 16, 256), dtype=mx.bfloat16), x, ws)
    assert "float16" in cm.joined_supported(c.astype(mx.float16), x, ws)
    assert "no context rows" in cm.joined_supported(c[:, :0], x, ws)
    assert "1 to 128" in cm.joined_supported(mx.zeros((1, 120, 256), dtype=mx.bfloat16), x, ws)
    with pytest.raises(ValueError, match="joined launch cannot take"):
        cm.joined_matmul_cuda(c[0], x, ws, norm=(mx.ones((256,), dtype=mx.bfloat16), 1e-6))
    with pytest.raises(ValueError, match="column split"):
        cm.grouped_source(2, columns=True, joined=True)


@pytest.mark.parametrize("rows", [1, 16])
def test_emulated_normed_swiglu_launch_has_the_swiglu_launchs_bits(rows, emulated):
    x, nw, (wg, wu) = _inputs(rows, 512, [64, 64], mx.bfloat16, 3 + rows)
    y = cm.swiglu_matmul_cuda(x, wg, wu, norm=(nw, 1e-5))
    assert mx.array_equal(y, cm.swiglu_matmul_cuda(rms_model(x, nw, 1e-5), wg, wu))


def test_norm_supported_names_what_the_launch_cannot_take():
    x, nw, _ = _inputs(2, 256, [], mx.bfloat16, 1)
    assert cm.norm_supported(x, nw) is None
    assert "float32" in cm.norm_supported(x, nw.astype(mx.float32))
    assert "(128,)" in cm.norm_supported(x, nw[:128])
    big = mx.zeros((1, 2 * cm.NORM_MAX_K), dtype=mx.bfloat16)
    assert "another order" in cm.norm_supported(big, mx.ones((2 * cm.NORM_MAX_K,), mx.bfloat16))
    w = mx.zeros((32, 256), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="cannot norm"):
        cm.small_matmul_cuda(x, w, norm=(nw[:128], 1e-6))
    with pytest.raises(ValueError, match="no addend"):
        cm.small_matmul_cuda(x, w, norm=(nw, 1e-6), add=mx.zeros((2, 32), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="column split"):
        cm.grouped_source(2, columns=True, norm=True)


@cuda_only
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_cuda_normed_launches_equal_mlx_norm_then_the_product(rows):
    # The 4B's shapes: hidden 2560 into the Gated-DeltaNet input projections' widths, the MLP's
    # gate/up (9216) and one product.
    x, nw, ws = _inputs(rows, 2560, [8192, 4096, 32, 32], mx.bfloat16, rows)
    xn = mx.fast.rms_norm(x, nw, 1e-6)
    for y, want in zip(
        cm.grouped_matmul_cuda(x, ws, norm=(nw, 1e-6)), cm.grouped_matmul_cuda(xn, ws)
    ):
        assert mx.array_equal(y, want)
    assert mx.array_equal(
        cm.small_matmul_cuda(x, ws[1], norm=(nw, 1e-6)), cm.small_matmul_cuda(xn, ws[1])
    )
    _, _, (wg, wu) = _inputs(1, 2560, [9216, 9216], mx.bfloat16, 7)
    assert mx.array_equal(
        cm.swiglu_matmul_cuda(x, wg, wu, norm=(nw, 1e-6)), cm.swiglu_matmul_cuda(xn, wg, wu)
    )


def test_linear_paths_norm_in_the_launch_only_with_the_switch(emulated, monkeypatch):
    import mlx.nn as nn
    from mlx_lm.models.qwen3 import MLP

    from hf2q.errors import UsageError
    from hf2q.kernels import linear as lin
    from hf2q.kernels import select

    monkeypatch.setattr(select, "small_mm_enabled", lambda: True)  # (CPU: the kernels emulated)
    mx.random.seed(2)
    norm = nn.RMSNorm(128, eps=1e-6)
    norm.weight = (1 + 0.2 * mx.random.normal((128,))).astype(mx.bfloat16)
    mlp = MLP(128, 64)
    mlp.set_dtype(mx.bfloat16)
    x = (mx.random.normal((5, 128)) * 2).astype(mx.bfloat16)
    xn = rms_model(x, norm.weight, 1e-6)
    gp, up = mlp.gate_proj, mlp.up_proj

    monkeypatch.delenv(select.NORM_MM_ENV, raising=False)
    key = select.mm_key()
    assert not select.norm_mm_enabled()
    assert isinstance(lin.normed(norm, x, True), mx.array)  # off by default: MLX's norm
    monkeypatch.setenv(select.NORM_MM_ENV, "1")
    assert (
        select.mm_key() != key
        and "norms in their products' launches" in select.describe()["small_mm"]
    )
    h = lin.normed(norm, x, True)
    assert isinstance(h, lin.Normed) and h.shape == x.shape and h.dtype == x.dtype
    # the grouped launch, one product, the SwiGLU launch: each the bits of the norm, then it
    for got, want in zip(
        lin.linears([gp, up], h, True), cm.grouped_matmul_cuda(xn, [gp.weight, up.weight])
    ):
        assert mx.array_equal(got, want)
    assert mx.array_equal(lin.linear(gp, h, True), cm.small_matmul_cuda(xn, gp.weight))
    monkeypatch.setenv(select.MM_SWIGLU_ENV, "1")
    r = mx.random.normal((5, 128)).astype(mx.bfloat16)
    want = lin.linear(mlp.down_proj, cm.swiglu_matmul_cuda(xn, gp.weight, up.weight), True, add=r)
    assert mx.array_equal(lin.swiglu_mlp(mlp, h, True, add=r), want)
    # Where the launch cannot take it, the norm runs first (MLX's), and the products as before.
    assert mx.array_equal(lin.value(h), norm(x)) and lin.value(x) is x
    r64 = r[:, :64]
    assert mx.array_equal(lin.linear(gp, h, True, add=r64), lin.linear(gp, norm(x), True, add=r64))
    assert mx.array_equal(lin.swiglu_mlp(mlp, h, False), mlp(norm(x)))
    # Not made: frozen products, more rows than the limit, another norm class, rows too long.
    assert isinstance(lin.normed(norm, x, lin.FROZEN), mx.array)
    monkeypatch.setenv(select.NORM_MM_ROWS_ENV, "4")
    assert isinstance(lin.normed(norm, x, True), mx.array)
    assert isinstance(lin.normed(norm, x[:4], True), lin.Normed)
    assert "(up to 4 rows)" in select.describe()["small_mm"]
    monkeypatch.delenv(select.NORM_MM_ROWS_ENV)
    assert isinstance(lin.normed(nn.LayerNorm(128), x, True), mx.array)
    long = nn.RMSNorm(2 * cm.NORM_MAX_K)
    long.set_dtype(mx.bfloat16)
    xl = mx.ones((1, 2 * cm.NORM_MAX_K), dtype=mx.bfloat16)
    assert isinstance(lin.normed(long, xl, True), mx.array)
    # A bad setting names the fix.
    monkeypatch.setenv(select.NORM_MM_ENV, "2")
    with pytest.raises(UsageError, match=f"{select.NORM_MM_ENV}='2' must be 0 or 1"):
        select.norm_mm_enabled()


def test_norms_stay_mlxs_under_an_mlx_whose_order_is_not_checked(monkeypatch):
    # A verify past the row limit takes MLX's norm and its plain steps the launch's: the same
    # bits only in the order the launch follows, so another MLX keeps MLX's norm everywhere
    # and --stats says why.
    import mlx.nn as nn

    from hf2q.kernels import linear as lin
    from hf2q.kernels import select

    monkeypatch.setattr(select, "small_mm_enabled", lambda: True)
    monkeypatch.setenv(select.NORM_MM_ENV, "1")
    norm = nn.RMSNorm(128)
    norm.set_dtype(mx.bfloat16)
    x = mx.ones((2, 128), dtype=mx.bfloat16)
    for version in ("0.32.4", "0.32.1", "0.32.4.dev20261201+abc"):
        monkeypatch.setattr(mx, "__version__", version)
        assert cm.norm_order_known() and select.norm_mm_enabled()
        assert isinstance(lin.normed(norm, x, True), lin.Normed)
    for version in ("0.32.0", "0.33.0", "0.31.2"):
        monkeypatch.setattr(mx, "__version__", version)
        assert not cm.norm_order_known() and not select.norm_mm_enabled()
        assert isinstance(lin.normed(norm, x, True), mx.array)
        assert f"MLX {version} may sum them in another order" in select.describe()["small_mm"]


def test_joined_linears_take_the_joined_launch_for_normed_rows(emulated, monkeypatch):
    import mlx.nn as nn

    from hf2q.kernels import linear as lin
    from hf2q.kernels import select

    monkeypatch.setattr(select, "small_mm_enabled", lambda: True)  # (CPU: the kernels emulated)
    monkeypatch.setenv(select.NORM_MM_ENV, "1")
    mx.random.seed(6)
    norm = nn.RMSNorm(128, eps=1e-6)
    norm.weight = (1 + 0.2 * mx.random.normal((128,))).astype(mx.bfloat16)
    kp, vp = nn.Linear(128, 64, bias=False), nn.Linear(128, 64, bias=False)
    kp.set_dtype(mx.bfloat16)
    vp.set_dtype(mx.bfloat16)
    ctx = mx.random.normal((1, 16, 128)).astype(mx.bfloat16)
    x = (mx.random.normal((1, 16, 128)) * 2).astype(mx.bfloat16)
    kinds: list[str] = []
    real = cm._norm_kernel
    monkeypatch.setattr(cm, "_norm_kernel", lambda kind, eps: kinds.append(kind) or real(kind, eps))
    h = lin.normed(norm, x, True)
    got = lin.joined_linears([kp, vp], ctx, h, True)
    rows = mx.concatenate([ctx, rms_model(x, norm.weight, 1e-6)], axis=1)
    want = cm.grouped_matmul_cuda(rows, [kp.weight, vp.weight])
    assert kinds == ["joined2"] and all(mx.array_equal(a, b) for a, b in zip(got, want))
    # Rows MLX normed already, or a layer with a bias: the concatenation and the products.
    plain = lin.joined_linears([kp, vp], ctx, norm(x), True)
    want = lin.linears([kp, vp], mx.concatenate([ctx, norm(x)], axis=1), True)
    assert all(mx.array_equal(a, b) for a, b in zip(plain, want)) and kinds == ["joined2"]
    biased = nn.Linear(128, 64)
    biased.set_dtype(mx.bfloat16)
    lin.joined_linears([kp, biased], ctx, h, True)
    assert kinds == ["joined2"]


def products_in_cuda_order(monkeypatch) -> list[str]:
    """For whole-model tests with the (emulated) launches: the products on the small-M kernel,
    MLX's weighted RMS norm computed in its CUDA order (:func:`rms_model`: the CPU's own sums
    in another order), and the kinds of the normed launches made, in the returned list."""
    from hf2q.kernels import select

    monkeypatch.setattr(select, "small_mm_enabled", lambda: True)
    own = mx.fast.rms_norm
    monkeypatch.setattr(
        mx.fast, "rms_norm", lambda x, w, eps: own(x, w, eps) if w is None else rms_model(x, w, eps)
    )
    kinds: list[str] = []
    real = cm._norm_kernel
    monkeypatch.setattr(cm, "_norm_kernel", lambda kind, eps: kinds.append(kind) or real(kind, eps))
    return kinds


def test_decode_steps_with_norms_in_the_launches_equal_them_without(emulated, monkeypatch):
    # A tiny bf16 Qwen3.5 (hidden 64, every product grouped) through the compiled runners with
    # the products on the (emulated) kernels, MLX's norm computed in the CUDA order (the model):
    # with HF2Q_NORM_MM=1 every layer's two norms run in the launches, and the logits of a
    # prefill and of decode steps are equal bit for bit to the runs without.
    import checkpoints as ck
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.cache import make_prompt_cache

    from hf2q.kernels import select
    from hf2q.kernels.layers import fast_layer_fn
    from hf2q.runtime.target import TargetModel

    args = qwen3_5.TextModelArgs(**dict(ck.TINY_TEXT_ARGS, linear_num_value_heads=8))
    mx.random.seed(11)
    model = qwen3_5.TextModel(args)
    model.set_dtype(mx.bfloat16)
    target = TargetModel(model)
    kinds = products_in_cuda_order(monkeypatch)
    tokens = mx.array([[3, 14, 15, 9, 2, 6, 5]])
    outs = []
    mx.disable_compile()  # (emulated launches read their inputs)
    try:
        for flag in ("0", "1"):
            monkeypatch.setenv(select.NORM_MM_ENV, flag)
            cache = make_prompt_cache(target.model)
            fn = fast_layer_fn(mm=True)
            steps = [target.forward(tokens[:, :3], cache, layer_fn=fn)[0]]
            for i in range(3, tokens.shape[1]):
                steps.append(target.forward(tokens[:, i : i + 1], cache, layer_fn=fn)[0])
            outs.append(mx.concatenate(steps, axis=1))
    finally:
        mx.enable_compile()
    # two launches a layer a forward (input norm: q/k/v or the four input projections; the
    # MLP's gate/up), five forwards
    assert len(kinds) == 2 * len(target.layers) * 5 and set(kinds) == {
        "grouped2",
        "grouped3",
        "grouped4",
    }
    assert mx.array_equal(outs[0], outs[1])


@cuda_only
@pytest.mark.parametrize("K", [256, 640, 1024, 1536, 2560, 3072, 4096, 5120])
def test_cuda_normed_rows_are_mlx_norm_kernels_over_many_rows(K):
    # The norm alone (the launch's product with an identity weight: each output is one normed
    # value, exact) against MLX's kernel over 4096 rows of each of MLX's dispatch shapes. An
    # order of summation not MLX's puts r a float32 step off in about one row in eight (the
    # numpy models of MLX 0.32.0's and 0.32.4's orders at 2560, here) and a value a rounding
    # apart in a few percent of those: 81 rows missed it in session 60; a 4B target's decoding
    # found it.
    mx.random.seed(K)
    eye = mx.eye(K, dtype=mx.bfloat16)
    nw = (1 + 0.2 * mx.random.normal((K,))).astype(mx.bfloat16)
    for _ in range(32):
        x = (mx.random.normal((128, K)) * mx.random.uniform(0.1, 4, (128, 1))).astype(mx.bfloat16)
        got = cm.small_matmul_cuda(x, eye, norm=(nw, 1e-6))
        assert mx.array_equal(got, mx.fast.rms_norm(x, nw, 1e-6))


@cuda_only
def test_cuda_norms_in_the_launches_keep_the_demo_targets_logits(monkeypatch):
    from conftest import assert_switch_keeps_demo_logits

    from hf2q.kernels import select

    monkeypatch.setenv(select.NORM_MM_ENV, "1")
    assert select.norm_mm_enabled()  # (this MLX's norm order is the launches': not vacuous)
    assert_switch_keeps_demo_logits(monkeypatch, select.NORM_MM_ENV)
