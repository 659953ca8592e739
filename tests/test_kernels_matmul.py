"""The small-M tensor-core product (hf2q/kernels/cuda_matmul.py) and its dispatch (linear.py).

On this CPU the kernel source runs in the CUDA emulator (tests/cuda_emu.py), whose warp-level
``mma`` follows the PTX ISA's fragment layout: that checks the kernel's indexing (which lane loads
which weights and inputs, the k permutation, the cross-warp sum, the stores) against a float32
product. The CUDA tests run the real kernel.
"""

from __future__ import annotations

import graph_ops
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import assert_switch_keeps_demo_logits
from mlx_lm.models.qwen3 import MLP

from hf2q.errors import UsageError
from hf2q.kernels import cuda_matmul as cm
from hf2q.kernels import linear as lin
from hf2q.kernels import select

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


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
def test_emulated_kernel_computes_the_product(emulated_mm, rows, dtype):
    x, w = _inputs(rows, 256, 48, dtype)
    y = cm.small_matmul_cuda(x, w)
    assert y.dtype == dtype and y.shape == (rows, 48)
    _assert_rounded_product(y, x, w)


@pytest.mark.parametrize("tune", [(1, 1, 1), (2, 4, 2), (4, 2, 4), (8, 4, 1)])
def test_emulated_kernel_every_launch_shape(emulated_mm, tune):
    x, w = _inputs(17, 512, 64, mx.bfloat16, seed=1)
    _assert_rounded_product(cm.small_matmul_cuda(x, w, tune=tune), x, w)


def test_emulated_narrow_one_tile_launch_is_opt_in_and_keeps_the_bits(emulated_mm, monkeypatch):
    # HF2Q_MM_NARROW=1: one column block unrolled twice for one m-tile of a narrow output, the
    # same bits as the default launch (two blocks, unrolled once); the traced runners' caches
    # key on the setting.
    x, w = _inputs(3, 512, 64, mx.bfloat16, seed=4)
    monkeypatch.delenv(cm.NARROW_ENV, raising=False)
    assert cm._layout(3, 512, 64, None, False)[1:4] == (2, 4, 1)
    key, y = select.mm_key(), cm.small_matmul_cuda(x, w)
    monkeypatch.setenv(cm.NARROW_ENV, "1")
    assert cm._layout(3, 512, 64, None, False)[1:4] == (
        cm.ONE_TILE_NARROW[0],
        4,
        cm.ONE_TILE_NARROW[1],
    )
    assert mx.array_equal(cm.small_matmul_cuda(x, w), y)
    assert cm._layout(20, 512, 64, None, False)[1:4] == cm.launch_shape(20, 512, 64)[1:]
    if select.mm_columns_enabled():
        assert select.mm_key() != key
    monkeypatch.setenv(cm.NARROW_ENV, "yes")
    with pytest.raises(UsageError, match=f"{cm.NARROW_ENV}='yes' must be 0 or 1"):
        cm.small_matmul_cuda(x, w)


def test_emulated_kernel_many_rows_launch_keeps_each_rows_bits(emulated_mm):
    # 2 m-tiles take eight column blocks, unrolled (two where N is not a multiple of 64), 3
    # m-tiles eight blocks (four, unrolled, where N is not a multiple of 64), 4
    # m-tiles four blocks and an unrolled chunk loop, 5-8 four blocks unrolled once (two where N
    # is not a multiple of 32): same bits.
    x, w = _inputs(100, 512, 64, mx.bfloat16, seed=9)
    assert cm.launch_shape(20, 512, 64)[1:] == (8, 4, 4)
    assert cm.launch_shape(20, 512, 48)[1:] == (2, 4, 1)
    assert cm.launch_shape(40, 512, 64)[1:] == (8, 4, 1)
    assert cm.launch_shape(40, 512, 32)[1:] == (4, 4, 4)
    assert cm.launch_shape(50, 512, 64)[1:] == (4, 4, 4)
    assert cm.launch_shape(100, 512, 64)[1:] == (4, 4, 1)
    assert cm.launch_shape(128, 512, 48)[1:] == (2, 4, 1)
    for rows in (20, 40, 50, 100):
        y = cm.small_matmul_cuda(x[:rows], w)
        _assert_rounded_product(y, x[:rows], w)
        assert mx.array_equal(y[-1:], cm.small_matmul_cuda(x[rows - 1 : rows], w))
    # Two blocks, unrolled once (5-8 m-tiles of a width not a multiple of 32): the same bits.
    assert mx.array_equal(cm.small_matmul_cuda(x, w, tune=(2, 4, 1)), y)


def test_emulated_kernel_rejects_a_malformed_tune(emulated_mm):
    x, w = _inputs(4, 128, 16, mx.bfloat16)
    for bad in [(2, 4), (2, 4, 1, 2, 1, 1), (2, 1, 1, 2), (2, 4, 1, 1, 2), (2, 4, 1, 2, 4)]:
        with pytest.raises(ValueError, match="tune"):
            cm.small_matmul_cuda(x, w, tune=bad)
    x = mx.zeros((128, 512), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):  # 8 m-tiles x 8 blocks x 8 warps
        cm.small_matmul_cuda(x, mx.zeros((64, 512), dtype=mx.bfloat16), tune=(8, 8, 1))


def test_emulated_kernel_rows_are_independent_of_the_batch(emulated_mm):
    x, w = _inputs(16, 256, 32, mx.bfloat16, seed=2)
    batch = cm.small_matmul_cuda(x, w)
    for i in (0, 7, 15):
        assert mx.array_equal(cm.small_matmul_cuda(x[i : i + 1], w)[0], batch[i])


def test_emulated_kernel_keeps_leading_axes(emulated_mm):
    x, w = _inputs(6, 128, 16, mx.bfloat16, seed=3)
    y = cm.small_matmul_cuda(x.reshape(2, 3, 128), w)
    assert y.shape == (2, 3, 16)
    assert mx.array_equal(y.reshape(6, 16), cm.small_matmul_cuda(x, w))


@pytest.mark.parametrize("K", [512, 640])  # K-subsets of two chunks; of three, three, two, two
def test_emulated_column_split_has_the_k_splits_bits(emulated_mm, K):
    # The column-split layout (each warp runs every chunk, K-subset by K-subset, x staged once a
    # block) computes every element with the K-split's operations: the same bits, at every row
    # count (partial m-tiles too), column width, unrolling and depth of the loads ahead (2 or 3
    # chunks of weights in a ring of 3 or 4 register sets and of x in 4 or 5 shared buffers, 8
    # and 10 chunks leaving a partial turn).
    x, w = _inputs(100, K, 128, mx.bfloat16, seed=11)
    warps = cm.launch_shape(100, K, 128)[2]
    assert warps == 4
    for rows in (1, 50, 100):
        ref = cm.small_matmul_cuda(x[:rows], w)
        for tune in [(2, warps, 1, 2), (1, warps, 2, 4), (2, warps, 1, 2, 2), (1, warps, 1, 4, 3)]:
            assert mx.array_equal(cm.small_matmul_cuda(x[:rows], w, tune=tune), ref), (rows, tune)
    _assert_rounded_product(ref, x, w)


def test_emulated_cols64_is_opt_in_at_four_m_tiles_and_keeps_the_bits(
    emulated_grouped, monkeypatch
):
    # HF2Q_MM_COLS64=NBxCWxD: launches of four m-tiles with enough columns (a 4-slot verify's MLP
    # gate and up; made small here) take the column split with NB blocks a warp, CW warps and
    # the weights and x D chunks ahead: the same bits as the K-split, single and grouped; fewer
    # columns, other row counts and widths the block does not divide keep the default, and the
    # traced runners' caches key on it.
    monkeypatch.setattr(cm, "COLS64_MIN_COLUMNS", 192)
    monkeypatch.delenv(cm.COLS64_ENV, raising=False)
    mx.random.seed(21)
    x = mx.random.normal((64, 512)).astype(mx.bfloat16)
    w = (mx.random.normal((128, 512)) * 0.04).astype(mx.bfloat16)
    small = (mx.random.normal((64, 512)) * 0.04).astype(mx.bfloat16)
    assert cm.column_shape(64, 512, 128) is None
    key, ref, ref_small = (
        select.mm_key(),
        cm.small_matmul_cuda(x, w),
        cm.small_matmul_cuda(x, small),
    )
    seen = []

    def spy(groups, columns=False):  # the layout each grouped launch takes
        kern = emulated_grouped(groups, columns)
        return lambda **kw: seen.append((columns, dict(kw["template"]))) or kern(**kw)

    monkeypatch.setattr(cm, "_grouped_kernel", spy)
    for cols in ("2x2x3", "1x4x2", "2x2x1"):
        monkeypatch.setenv(cm.COLS64_ENV, cols)
        nb, cw, depth = (int(v) for v in cols.split("x"))
        assert cm.column_shape(64, 512, 128, total=192) == (nb, cw, depth)
        assert cm.column_shape(64, 512, 128) is None  # 128 columns alone: too few
        assert cm.column_shape(50, 512, 128, total=192) == (nb, cw, depth)
        assert cm.column_shape(48, 512, 128, total=192) is None  # three m-tiles: the default
        ys = cm.grouped_matmul_cuda(x, [w, small], columns=True)
        assert seen[-1][0] and (seen[-1][1]["CW"], seen[-1][1]["D"]) == (cw, depth)
        assert mx.array_equal(ys[0], ref), cols
        assert mx.array_equal(ys[1], ref_small), cols
        ys = cm.grouped_matmul_cuda(x[:50], [w, small], columns=True)
        assert mx.array_equal(ys[0], ref[:50]), cols
        cm.grouped_matmul_cuda(x, [w, small], columns=False)  # the column switch off: K-split
        assert not seen[-1][0]
        assert select.mm_key() != key
    monkeypatch.setenv(cm.COLS64_ENV, "4x4x3")
    assert cm.column_shape(64, 512, 64, total=192) is None  # 128-column blocks do not divide 64
    for bad in ("2x4", "8x4x1", "2x1x2", "2x4x4", "ax4x2"):
        monkeypatch.setenv(cm.COLS64_ENV, bad)
        with pytest.raises(UsageError, match=f"{cm.COLS64_ENV}='{bad}' must be NBxCWxD"):
            cm.grouped_matmul_cuda(x, [w, small], columns=True)


def test_column_split_is_used_where_it_keeps_the_weight_stream_spread():
    # Qwen3.5-4B's shapes at a 4-slot verify (64 rows): the tied head (1940 blocks of 128
    # columns) takes it; the MLP's gate and up grouped (144 blocks), 2560-column products (20)
    # and one or two m-tiles do not, nor five and more.
    assert cm.column_shape(64, 2560, 9216, total=2 * 9216) is None
    assert cm.column_shape(64, 2560, 9216, total=1024 * 128) == (2, cm.COLUMN_WARPS, 1)
    assert cm.column_shape(64, 2560, 248320) == (2, cm.COLUMN_WARPS, 1)
    assert cm.column_shape(48, 2560, 248320) == (2, cm.COLUMN_WARPS, 1)
    assert cm.column_shape(128, 2560, 248320) is None  # five m-tiles and more: the K-split
    assert cm.column_shape(64, 9216, 2560) is None
    assert cm.column_shape(32, 2560, 248320) is None
    assert cm.column_shape(64, 128, 248320) is None  # one warp: no running sum to keep
    x = mx.zeros((64, 256), dtype=mx.bfloat16)
    w = mx.zeros((128 * cm.COLUMN_MIN_BLOCKS, 256), dtype=mx.bfloat16)
    assert cm._layout(64, 256, w.shape[0], None, True)[4] == cm.COLUMN_WARPS
    assert cm._layout(64, 256, w.shape[0], None, False)[4] == 1
    assert cm._layout(x.shape[0], 256, 128, None, True)[4] == 1


@pytest.mark.parametrize(
    "rows,widths",
    [
        (1, (64, 32, 16, 8)),
        (16, (96, 32)),
        (19, (64, 64, 32)),
        (3, (256, 128, 16, 16)),
        (40, (128, 32)),  # the narrower weight's launch: four blocks, unrolled
    ],
)
def test_emulated_grouped_kernel_gives_each_product_the_single_kernels_bits(
    emulated_grouped, rows, widths
):
    mx.random.seed(rows)
    x = mx.random.normal((rows, 256)).astype(mx.bfloat16)
    ws = [(mx.random.normal((n, 256)) * 0.0625).astype(mx.bfloat16) for n in widths]
    assert cm.grouped_supported(x, ws) is None
    ys = cm.grouped_matmul_cuda(x, ws)
    assert [y.shape for y in ys] == [(rows, n) for n in widths]
    for w, y in zip(ws, ys):
        assert mx.array_equal(y, cm.small_matmul_cuda(x, w))
        _assert_rounded_product(y, x, w)


def test_emulated_grouped_column_split_gives_the_single_kernels_bits(emulated_grouped, monkeypatch):
    # Made small: blocks of 32 columns (two 8-column blocks a warp, two warps), from one block.
    monkeypatch.setattr(cm, "COLUMN_WARPS", 2)
    monkeypatch.setattr(cm, "COLUMN_MIN_BLOCKS", 1)
    mx.random.seed(4)
    x = mx.random.normal((60, 512)).astype(mx.bfloat16)
    ws = [(mx.random.normal((n, 512)) * 0.04).astype(mx.bfloat16) for n in (64, 32)]
    assert all(cm.column_shape(60, 512, w.shape[0]) == (2, 2, 1) for w in ws)
    for y, w in zip(cm.grouped_matmul_cuda(x, ws, columns=True), ws):
        assert mx.array_equal(y, cm.small_matmul_cuda(x, w))


def _cuda_swiglu(gate, up):
    """SwiGLU of two bf16/fp16 arrays as MLX's CUDA elementwise kernel computes mlx-lm's
    ``swiglu`` (``gate * sigmoid(gate) * up``, every intermediate rounded to the dtype; its
    sigmoid ``1 / (1 + exp(|x|))``, mirrored for x >= 0), in numpy. (The GPU's ``expf`` may
    round a value differently; the CUDA test compares with MLX's own kernel.)"""
    dt = gate.dtype

    def r(a):
        return np.array(mx.array(a.astype(np.float32)).astype(dt).astype(mx.float32))

    g = np.array(gate.astype(mx.float32))
    u = np.array(up.astype(mx.float32))
    e = np.exp(np.abs(g).astype(np.float64)).astype(np.float32)  # (expf correctly rounded)
    y = r(1.0 / r(1.0 + r(e)))
    sig = np.where(g < 0, y, r(1.0 - y))
    return r(r(g * sig) * u)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "rows,K,N",
    [(1, 256, 64), (16, 256, 64), (19, 512, 128), (40, 256, 64), (64, 512, 64), (3, 64, 32)],
)
def test_emulated_swiglu_launch_is_the_grouped_products_swiglu(emulated_swiglu, rows, K, N, dtype):
    # Each output is SwiGLU of the grouped launch's gate and up values (the kernel's sums have
    # their bits), with MLX's CUDA roundings; one warp (K = 64) and several, one to four m-tiles.
    mx.random.seed(rows + K)
    x = mx.random.normal((rows, K)).astype(dtype)
    wg = (mx.random.normal((N, K)) * 3 * K**-0.5).astype(dtype)
    wu = (mx.random.normal((N, K)) * K**-0.5).astype(dtype)
    assert cm.swiglu_supported(x, wg, wu) is None
    y = cm.swiglu_matmul_cuda(x, wg, wu)
    assert y.shape == (rows, N) and y.dtype == dtype
    gate, up = cm.grouped_matmul_cuda(x, [wg, wu])
    assert np.array_equal(np.array(y.astype(mx.float32)), _cuda_swiglu(gate, up))
    # and the batch dimensions of a verify (slots, rows, K) are kept
    y3 = cm.swiglu_matmul_cuda(x.reshape(1, rows, K), wg, wu)
    assert y3.shape == (1, rows, N) and mx.array_equal(y3[0], y)


def test_swiglu_supported_names_what_it_cannot_do(monkeypatch):
    x = mx.zeros((2, 128), dtype=mx.bfloat16)
    w = mx.zeros((64, 128), dtype=mx.bfloat16)
    assert cm.swiglu_supported(x, w, w) is None
    assert "differ in shape" in cm.swiglu_supported(x, w, mx.zeros((32, 128), dtype=mx.bfloat16))
    assert "N=12" in cm.swiglu_supported(x, *[mx.zeros((12, 128), dtype=mx.bfloat16)] * 2)
    narrow = mx.zeros((8, 128), dtype=mx.bfloat16)  # one 8-column block: the grouped launch
    assert "one 8-column block" in cm.swiglu_supported(x, narrow, narrow)
    with pytest.raises(ValueError, match="one 8-column block"):
        cm.swiglu_matmul_cuda(x, narrow, narrow)
    assert "dtypes" in cm.swiglu_supported(x.astype(mx.float32), w, w)
    # Where the grouped launch would take the column split (HF2Q_MM_COLS64 at four m-tiles),
    # that layout is left to it; not otherwise.
    monkeypatch.setattr(cm, "COLS64_MIN_COLUMNS", 128)
    monkeypatch.setenv(cm.COLS64_ENV, "2x2x1")
    x64, w256 = mx.zeros((64, 256), dtype=mx.bfloat16), mx.zeros((64, 256), dtype=mx.bfloat16)
    assert cm.swiglu_supported(x64, w256, w256) is None
    assert "column split takes 64 rows" in cm.swiglu_supported(x64, w256, w256, columns=True)
    assert cm.swiglu_supported(x64[:16], w256, w256, columns=True) is None  # one m-tile


def test_swiglu_mlp_takes_the_one_launch_only_with_its_switch(emulated_swiglu, monkeypatch):
    mlp = MLP(128, 64)
    mlp.set_dtype(mx.bfloat16)
    mx.random.seed(3)
    x = mx.random.normal((5, 128)).astype(mx.bfloat16)
    r = mx.random.normal((5, 128)).astype(mx.bfloat16)
    calls = []
    real = cm.swiglu_matmul_cuda
    monkeypatch.setattr(
        cm, "swiglu_matmul_cuda", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    monkeypatch.setattr(select, "small_mm_enabled", lambda: True)  # (CPU: the kernels emulated_mm)
    monkeypatch.delenv(select.MM_SWIGLU_ENV, raising=False)
    key = select.mm_key()
    lin.swiglu_mlp(mlp, x, True, add=r)
    assert calls == [] and not select.mm_swiglu_enabled()
    monkeypatch.setenv(select.MM_SWIGLU_ENV, "1")
    assert select.mm_swiglu_enabled() and select.mm_key() != key
    assert "SwiGLU in its gate/up launch" in select.describe()["small_mm"]
    got = lin.swiglu_mlp(mlp, x, True, add=r)
    assert calls == [(5, 128)]
    gate, up = cm.grouped_matmul_cuda(x, [mlp.gate_proj.weight, mlp.up_proj.weight])
    act = mx.array(_cuda_swiglu(gate, up)).astype(mx.bfloat16)
    assert mx.array_equal(got, lin.linear(mlp.down_proj, act, True, add=r))
    # Not in one launch: drafts' frozen products, grouping off, a bad setting names the fix.
    lin.swiglu_mlp(mlp, x, lin.FROZEN)
    monkeypatch.setenv(select.GROUPED_MM_ENV, "0")
    lin.swiglu_mlp(mlp, x, True)
    assert len(calls) == 1
    monkeypatch.delenv(select.GROUPED_MM_ENV)
    # HF2Q_MM_SWIGLU_ROWS: the launch only up to that many rows (traces keyed by it)
    key = select.mm_key()
    monkeypatch.setenv(select.MM_SWIGLU_ROWS_ENV, "4")
    assert select.mm_key() != key and "(up to 4 rows)" in select.describe()["small_mm"]
    lin.swiglu_mlp(mlp, x, True)  # 5 rows: the grouped launch and mlx-lm's swiglu
    lin.swiglu_mlp(mlp, x[:4], True)
    assert calls == [(5, 128), (4, 128)]
    monkeypatch.setenv(select.MM_SWIGLU_ROWS_ENV, "999")
    with pytest.raises(UsageError, match="HF2Q_MM_SWIGLU_ROWS=999 is more than"):
        select.mm_swiglu_rows()
    monkeypatch.delenv(select.MM_SWIGLU_ROWS_ENV)
    monkeypatch.setenv(select.MM_SWIGLU_ENV, "2")
    with pytest.raises(UsageError, match=f"{select.MM_SWIGLU_ENV}='2' must be 0 or 1"):
        select.mm_swiglu_enabled()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
def test_emulated_residual_in_the_launch_has_the_bits_of_the_two_steps(
    emulated_add, monkeypatch, dtype
):
    x, w = _inputs(5, 256, 64, dtype, seed=8)
    r = mx.random.normal((5, 64)).astype(dtype)
    assert mx.array_equal(cm.small_matmul_cuda(x, w, add=r), cm.small_matmul_cuda(x, w) + r)
    # the column-split layout's store adds the same way
    warps = cm.launch_shape(5, 256, 64)[2]
    split = cm.small_matmul_cuda(x, w, add=r, tune=(2, warps, 1, 2))
    assert mx.array_equal(split, cm.small_matmul_cuda(x, w) + r)
    with pytest.raises(ValueError, match="addend"):
        cm.small_matmul_cuda(x, w, add=r[:, :32])
    # linear(): the residual in the launch only with the switch, the same values either way.
    mod = nn.Linear(256, 64, bias=False)
    mod.set_dtype(dtype)
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: True)
    fused = lin.linear(mod, x, True, add=r)
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: False)
    assert mx.array_equal(fused, lin.linear(mod, x, True, add=r))
    assert mx.array_equal(lin.linear(mod, x, False, add=r), mod(x) + r)


def test_grouped_supported_names_what_it_cannot_do():
    x = mx.zeros((2, 128), dtype=mx.bfloat16)
    w = mx.zeros((32, 128), dtype=mx.bfloat16)
    assert "1 weights" in cm.grouped_supported(x, [w])
    assert "5 weights" in cm.grouped_supported(x, [w] * 5)
    assert "do not multiply" in cm.grouped_supported(x, [w, mx.zeros((32, 64), dtype=mx.bfloat16)])
    assert "N=12" in cm.grouped_supported(x, [w, mx.zeros((12, 128), dtype=mx.bfloat16)])


def test_linears_groups_products_sharing_an_input(emulated_grouped, monkeypatch):
    x, _ = _inputs(4, 128, 32, mx.bfloat16, seed=6)
    mods = [nn.Linear(128, n, bias=False) for n in (64, 32, 8)]
    for m in mods:
        m.set_dtype(mx.bfloat16)
    calls = []
    real = cm.grouped_matmul_cuda
    monkeypatch.setattr(
        cm, "grouped_matmul_cuda", lambda x, ws, **k: calls.append(len(ws)) or real(x, ws, **k)
    )
    separate = [lin.linear(m, x, True) for m in mods]
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: False)  # the switch off: no group
    assert all(mx.array_equal(a, b) for a, b in zip(lin.linears(mods, x, True), separate))
    assert calls == []
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: True)
    grouped = lin.linears(mods, x, True)
    assert calls == [3] and all(mx.array_equal(a, b) for a, b in zip(grouped, separate))
    # Not grouped: the kernel off, a layer with a bias, a float32 input.
    assert all(mx.array_equal(a, m(x)) for a, m in zip(lin.linears(mods, x, False), mods))
    biased = nn.Linear(128, 16, bias=True)
    biased.set_dtype(mx.bfloat16)
    lin.linears([mods[0], biased], x, True)
    x32 = x.astype(mx.float32)
    mods32 = [nn.Linear(128, 32, bias=False), nn.Linear(128, 16, bias=False)]
    assert all(mx.array_equal(a, m(x32)) for a, m in zip(lin.linears(mods32, x32, True), mods32))
    assert calls == [3]
    # An mlx-lm SwiGLU MLP: gate and up in one launch, the same values as separately.
    mlp = MLP(128, 192)
    mlp.set_dtype(mx.bfloat16)
    y = lin.swiglu_mlp(mlp, x, True)
    assert calls == [3, 2]
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: False)
    assert mx.array_equal(y, lin.swiglu_mlp(mlp, x, True))


def test_supported_names_what_it_cannot_do():
    x, w = _inputs(4, 128, 16, mx.bfloat16)
    assert cm.supported(x, w) is None
    assert "bf16 or fp16" in cm.supported(x.astype(mx.float32), w.astype(mx.float32))
    assert "multiple of 64" in cm.supported(x[:, :96], w[:, :96])
    assert "multiple of 64" in cm.supported(x[:, :0], w[:, :0])
    assert "multiple of 8" in cm.supported(x, w[:12])
    big = mx.zeros((cm.MAX_ROWS + 1, 128), dtype=mx.bfloat16)
    assert f"1 to {cm.MAX_ROWS}" in cm.supported(big, w)


def test_fits_keeps_many_rows_of_large_weights_on_cublas_only_when_told(monkeypatch):
    w_small = mx.zeros((256, 256), dtype=mx.bfloat16)
    w_large = mx.zeros((4096, 2048), dtype=mx.bfloat16)  # 8M elements > SMALL_WEIGHT
    monkeypatch.delenv(select.SMALL_MM_ROWS_ENV, raising=False)
    for rows, w, want in [(128, w_large, True), (129, w_large, False), (128, w_small, True)]:
        assert lin.fits(mx.zeros((rows, w.shape[1]), dtype=mx.bfloat16), w) is want
    monkeypatch.setenv(select.SMALL_MM_ROWS_ENV, "32")
    for rows, w, want in [(32, w_large, True), (33, w_large, False), (128, w_small, True)]:
        assert lin.fits(mx.zeros((rows, w.shape[1]), dtype=mx.bfloat16), w) is want


def test_kernel_rows_setting_keeps_large_weights_on_the_kernel(monkeypatch):
    w_large = mx.zeros((4096, 2048), dtype=mx.bfloat16)
    x64 = mx.zeros((64, 2048), dtype=mx.bfloat16)
    monkeypatch.delenv(select.SMALL_MM_ROWS_ENV, raising=False)
    assert select.small_mm_rows() == lin.ALWAYS_ROWS == cm.MAX_ROWS and lin.fits(x64, w_large)
    monkeypatch.setenv(select.SMALL_MM_ROWS_ENV, "32")
    assert select.small_mm_rows() == 32 and not lin.fits(x64, w_large)
    assert select.mm_key() == (
        select.grouped_mm_enabled(),
        32,
        select.mm_columns_enabled(),
        select.small_qmm_enabled(),
    )
    for bad, why in [("129", "more than the kernel's 128 rows"), ("many", "must be 0")]:
        monkeypatch.setenv(select.SMALL_MM_ROWS_ENV, bad)
        with pytest.raises(UsageError, match=why):
            select.small_mm_rows()


def test_linear_passes_the_column_switch_to_the_kernel(monkeypatch):
    # HF2Q_MM_COLUMNS reaches every product linear() sends to the kernel (single, residual,
    # grouped, head); the kernel's layout choice is cuda_matmul.column_shape's.
    seen = []
    monkeypatch.setattr(lin, "fits", lambda x, w: True)
    monkeypatch.setattr(lin, "_rows_fit", lambda x, w: True)
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: True)
    monkeypatch.setattr(cm, "small_matmul_cuda", lambda x, w, **k: seen.append(k["columns"]) or x)
    monkeypatch.setattr(cm, "grouped_matmul_cuda", lambda x, ws, **k: seen.append(k["columns"]))
    mod = nn.Linear(64, 64, bias=False)
    mod.set_dtype(mx.bfloat16)
    x = mx.zeros((4, 64), dtype=mx.bfloat16)
    for flag in (True, False):
        seen.clear()
        monkeypatch.setattr(select, "mm_columns_enabled", lambda flag=flag: flag)
        lin.linear(mod, x, True)
        lin.linear(mod, x, True, add=x)
        lin.linears([mod, mod], x, True)
        lin.head(nn.Embedding(64, 64), x, True)
        assert seen == [flag] * 4


def test_column_switch_is_cuda_only(monkeypatch):
    monkeypatch.setenv(select.MM_COLUMNS_ENV, "1")
    assert select.mm_columns_enabled() is select.small_mm_enabled()
    monkeypatch.setenv(select.MM_COLUMNS_ENV, "sometimes")
    if select.small_mm_enabled():
        with pytest.raises(UsageError, match=select.MM_COLUMNS_ENV):
            select.mm_columns_enabled()


def test_draft_rows_setting(monkeypatch):
    monkeypatch.delenv(select.DRAFT_MM_ROWS_ENV, raising=False)
    monkeypatch.delenv(select.DRAFT_HEAD_MM_ROWS_ENV, raising=False)
    assert select.draft_mm_rows() == select.DRAFT_MM_ROWS == 64
    assert select.draft_head_mm_rows() == select.DRAFT_HEAD_MM_ROWS == 32
    for raw, want in [("48", 48), ("0", 0), ("500", cm.MAX_ROWS)]:
        monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, raw)
        assert select.draft_mm_rows() == want
    # Drafts take the kernel only where it runs at all (CUDA) and within the rows.
    monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, "48")
    big, small = lin.SMALL_WEIGHT + 1, lin.SMALL_WEIGHT
    assert select.draft_mm_enabled(48, big) is select.small_mm_enabled()
    assert select.draft_mm_enabled(49, small) is select.small_mm_enabled()
    assert not select.draft_mm_enabled(49, big)
    # The head follows its own count where one is set, else 32 or the layers' if fewer.
    assert select.draft_head_mm_rows() == 32
    monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, "16")
    assert select.draft_head_mm_rows() == 16
    monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, "48")
    monkeypatch.setenv(select.DRAFT_HEAD_MM_ROWS_ENV, "48")
    assert select.draft_mm_enabled(48, big, head=True) is select.small_mm_enabled()
    monkeypatch.setenv(select.DRAFT_HEAD_MM_ROWS_ENV, "32")
    assert select.draft_head_mm_rows() == 32 and not select.draft_mm_enabled(48, big, head=True)
    assert select.draft_mm_enabled(48, big) is select.small_mm_enabled()
    assert select.draft_mm_enabled(48, small, head=True) is select.small_mm_enabled()
    monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, "many")
    with pytest.raises(UsageError, match="HF2Q_DRAFT_MM_ROWS='many' must be 0"):
        select.draft_mm_rows()
    monkeypatch.setenv(select.DRAFT_HEAD_MM_ROWS_ENV, "x")
    with pytest.raises(UsageError, match="HF2Q_DRAFT_HEAD_MM_ROWS='x' must be 0"):
        select.draft_head_mm_rows()


def test_drafter_layers_and_head_follow_their_own_row_counts(monkeypatch):
    import checkpoints as ck

    from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel

    cfg = ck.drafter_config(
        hidden_size=256, num_target_layers=8, target_layer_ids=[1, 3, 5], vocab_size=1 << 15
    )
    cfg["intermediate_size"] = (1 << 22) // 256 + 64  # one weight past SMALL_WEIGHT
    drafter = DFlashDraftModel(DFlashConfig.from_dict(cfg))  # its head: 8M elements
    monkeypatch.setattr(select, "small_mm_enabled", lambda: True)
    monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, "64")
    monkeypatch.setenv(select.DRAFT_HEAD_MM_ROWS_ENV, "32")
    assert drafter.kernel_products(64) and not drafter.kernel_products(64, head=True)
    assert drafter.kernel_products(32, head=True) and not drafter.kernel_products(65)


def test_linear_dispatch(emulated_mm, monkeypatch):
    # Single products only (on CUDA the MLP's gate and up are one grouped launch by default; the
    # grouped tests cover that), so the count is the same on every backend.
    monkeypatch.setenv(select.GROUPED_MM_ENV, "0")
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
    # Not for the kernel: quantized layers of float32 scales, float32, too many rows of a large
    # weight.
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


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_frozen_products_have_the_matmuls_bits_without_a_transpose_a_call(bias):
    """``on=FROZEN`` (the drafter's compiled layers off the kernel): the product of ``mod(x)``
    bit for bit, reading a transposed view made once, so no transpose node in each forward;
    a replaced weight is seen at once."""
    x, _ = _inputs(6, 64, 48, mx.bfloat16, seed=7)
    x = x.reshape(2, 3, 64)
    mod = nn.Linear(64, 48, bias=bias)
    mod.set_dtype(mx.bfloat16)
    mx.eval(mod.parameters())
    assert not lin.FROZEN  # falsy: every kernel decision reads it as off
    y = lin.linear(mod, x, lin.FROZEN)
    assert mx.array_equal(y, mod(x)).item()
    assert "Transpose" in graph_ops.ops(mod(x)) and "Transpose" not in graph_ops.ops(y)
    mod.weight = mod.weight * 2
    mx.eval(mod.parameters())
    assert mx.array_equal(lin.linear(mod, x, lin.FROZEN), mod(x)).item()
    mlp = MLP(64, 96)
    mlp.set_dtype(mx.bfloat16)
    mx.eval(mlp.parameters())
    got = lin.swiglu_mlp(mlp, x, lin.FROZEN, add=x)
    assert mx.array_equal(got, x + mlp(x)).item() and "Transpose" not in graph_ops.ops(got)


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
    for n in (1, 16, 32, 48, 64, 96):  # every launch shape: 1, 2, 3, 4 and 5-8 m-tiles
        part = cm.small_matmul_cuda(x[:n], w)
        assert mx.array_equal(part, full[:n])


@cuda_only
@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_cuda_grouped_kernel_gives_each_product_the_single_kernels_bits(rows):
    # A Qwen3.5-4B Gated-DeltaNet layer's input projections (qkv, z, b, a) and the MLP's gate/up.
    mx.random.seed(rows)
    x = mx.random.normal((rows, 2560)).astype(mx.bfloat16)
    for widths in [(8192, 4096, 32, 32), (9216, 9216)]:
        ws = [(mx.random.normal((n, 2560)) * 0.02).astype(mx.bfloat16) for n in widths]
        for w, y in zip(ws, cm.grouped_matmul_cuda(x, ws)):
            assert mx.array_equal(y, cm.small_matmul_cuda(x, w))


@cuda_only
@pytest.mark.parametrize("rows", [1, 16, 33, 64, 128])
def test_cuda_swiglu_launch_has_the_bits_of_grouped_products_and_mlx_swiglu(rows):
    # Qwen3.5-4B's MLP gate/up (and a narrow one): the one launch gives mlx-lm's compiled swiglu
    # of the grouped launch's outputs bit for bit, as MLX's CUDA backend computes it.
    from mlx_lm.models.activations import swiglu

    mx.random.seed(rows)
    for K, N in [(2560, 9216), (256, 64)]:
        x = mx.random.normal((rows, K)).astype(mx.bfloat16)
        wg = (mx.random.normal((N, K)) * 3 * K**-0.5).astype(mx.bfloat16)
        wu = (mx.random.normal((N, K)) * K**-0.5).astype(mx.bfloat16)
        gate, up = cm.grouped_matmul_cuda(x, [wg, wu])
        want = swiglu(gate, up)
        got = cm.swiglu_matmul_cuda(x, wg, wu)
        assert mx.array_equal(got, want), (K, N)


@cuda_only
def test_cuda_runners_give_the_same_logits_with_swiglu_in_the_launch(monkeypatch):
    assert_switch_keeps_demo_logits(monkeypatch, select.MM_SWIGLU_ENV)


@cuda_only
@pytest.mark.parametrize("rows", [48, 64, 100, 128])
def test_cuda_column_split_has_the_k_splits_bits(rows, monkeypatch):
    monkeypatch.setattr(cm, "COLUMN_MIN_BLOCKS", 128)  # (so that these shapes take it)
    # The MLP's gate/up grouped (Qwen3.5-4B) and a 17408-column product (136 blocks of 128),
    # with and without a residual: the column-split layout's bits are the K-split's.
    # (100 and 128 rows: the layout forced, column_shape leaves five m-tiles and more to the
    # K-split)
    mx.random.seed(rows)
    x = mx.random.normal((rows, 2560)).astype(mx.bfloat16)
    ws = [(mx.random.normal((9216, 2560)) * 0.02).astype(mx.bfloat16) for _ in range(2)]
    split = cm.grouped_matmul_cuda(x, ws, columns=True)
    for y, w in zip(split, ws):
        assert mx.array_equal(y, cm.small_matmul_cuda(x, w))
    w = (mx.random.normal((17408, 2560)) * 0.02).astype(mx.bfloat16)
    r = mx.random.normal((rows, 17408)).astype(mx.bfloat16)
    tune = None if rows <= 64 else (2, 8, 1, cm.COLUMN_WARPS)
    assert (cm.column_shape(rows, 2560, 17408) is None) is (tune is not None)
    got = cm.small_matmul_cuda(x, w, columns=True, tune=tune)
    assert mx.array_equal(got, cm.small_matmul_cuda(x, w))
    assert mx.array_equal(
        cm.small_matmul_cuda(x, w, add=r, columns=True, tune=tune),
        cm.small_matmul_cuda(x, w, add=r),
    )
    _assert_rounded_product(got, x, w)


@cuda_only
@pytest.mark.parametrize("cols", ["2x4x3", "1x8x3", "2x8x2", "2x8x1"])
def test_cuda_cols64_has_the_k_splits_bits(cols, monkeypatch):
    # HF2Q_MM_COLS64 on the GPU: the MLP's gate/up grouped (Qwen3.5-4B) at 64 and 50 rows, and
    # the tied head's shape with a residual, each weight's bits those of its K-split product.
    monkeypatch.setenv(cm.COLS64_ENV, cols)
    assert f"loaded {cols[-1]} chunks ahead" in select.describe()["small_mm"]  # --stats
    mx.random.seed(5)
    x = mx.random.normal((64, 2560)).astype(mx.bfloat16)
    ws = [(mx.random.normal((9216, 2560)) * 0.02).astype(mx.bfloat16) for _ in range(2)]
    for rows in (64, 50):
        assert cm.column_shape(rows, 2560, 9216, total=2 * 9216) == tuple(
            int(v) for v in cols.split("x")
        )
        for y, w in zip(cm.grouped_matmul_cuda(x[:rows], ws, columns=True), ws):
            assert mx.array_equal(y, cm.small_matmul_cuda(x[:rows], w))
    w = (mx.random.normal((17408, 2560)) * 0.02).astype(mx.bfloat16)
    r = mx.random.normal((64, 17408)).astype(mx.bfloat16)
    got = cm.small_matmul_cuda(x, w, add=r, columns=True)
    assert mx.array_equal(got, cm.small_matmul_cuda(x, w, add=r))


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_residual_in_the_launch_has_the_bits_of_mlx_add(rows, dtype):
    x, w = _inputs(rows, 9216, 2560, dtype, seed=7)
    r = mx.random.normal((rows, 2560)).astype(dtype)
    assert mx.array_equal(cm.small_matmul_cuda(x, w, add=r), cm.small_matmul_cuda(x, w) + r)


@cuda_only
def test_cuda_drafts_of_many_rows_run_mlx_matmul(demo_pair, monkeypatch):
    # HF2Q_DRAFT_MM_ROWS: a draft of more block rows than the setting runs no kernel product
    # where the drafter's weights are large (layers and head); its logits are the same products
    # rounded by cuBLAS instead. A small drafter (the demo pair's) stays on the kernel.
    import checkpoints as ck

    from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel

    target, demo = demo_pair.target, demo_pair.drafter
    cfg = ck.drafter_config(
        hidden_size=256, num_target_layers=8, target_layer_ids=[1, 3, 5], vocab_size=8192
    )
    cfg["intermediate_size"] = (1 << 22) // 256 + 64  # one weight past SMALL_WEIGHT
    mx.random.seed(2)
    big = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    big.set_dtype(target.dtype)
    mx.eval(big.parameters())
    big.bind(target.embed, target.head)
    H = 256 * 3
    feats = (mx.random.normal((2, 3, H)) * 0.5).astype(target.dtype)
    block = mx.concatenate([mx.full((2, 1), 5), mx.full((2, 15), demo.mask_token_id)], axis=1)
    block = block.astype(mx.int32)
    calls = []  # the weights' sizes (the demo target's head, bound to both, is small: 2M)
    real = cm.small_matmul_cuda
    monkeypatch.setattr(
        cm, "small_matmul_cuda", lambda x, w, **k: calls.append(w.size) or real(x, w, **k)
    )
    for drafter, kernel_above in ((big, False), (demo, True)):
        outs = []
        for rows in ("32", "31"):
            monkeypatch.setenv(select.DRAFT_MM_ROWS_ENV, rows)
            outs.append(drafter(block, feats, drafter.make_cache()).astype(mx.float32))
            mx.eval(outs[-1])
            assert bool(calls) and (max(calls) > lin.SMALL_WEIGHT) is (
                rows == "32" and not kernel_above
            )
            calls.clear()
        scale = mx.abs(outs[0]).max()
        assert (mx.abs(outs[1] - outs[0]).max() / scale).item() < 5e-2


@cuda_only
def test_cuda_runners_give_the_same_logits_with_grouped_products(monkeypatch):
    from hf2q.kernels.layers import fast_layer_fn
    from hf2q.runtime.pair import load_pair

    target = load_pair(None).target
    tokens = mx.array([[3, 14, 15, 92, 65, 35]])
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(select.GROUPED_MM_ENV, flag)
        logits = []
        cache = target.make_cache()
        for i in range(tokens.shape[1]):  # decode steps, one row each
            out, _ = target.forward(tokens[:, i : i + 1], cache, layer_fn=fast_layer_fn(mm=True))
            logits.append(out)
        outs.append(mx.concatenate(logits, axis=1))
    assert mx.array_equal(outs[0], outs[1])


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


def test_node_costs_chained_nodes_each_add_the_previous_output(emulated_add):
    # benchmarks/node_cost.py --chain: each timed node adds the one before it, so the device runs
    # them in turn as in a forward (independent nodes may overlap: the likely reason session 56's
    # tune ranked launches unlike the round); the last
    # output is then the sum of every product, for MLX's matmul and hf2q's kernel (its residual
    # in the launch, tuned launches too), and without --chain each node is its own product.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import node_cost

    x, w0 = _inputs(20, 512, 64, mx.float32, seed=13)
    ws = [w0, *(_inputs(20, 512, 64, mx.float32, seed=14 + i)[1] for i in range(2))]
    want = sum(x @ w.T for w in ws)
    kinds = node_cost._kinds(
        x.astype(mx.bfloat16),
        [w.astype(mx.bfloat16) for w in ws],
        True,
        True,
        only=[(2, 1, 1), (2, 1, 1, 2)],
        chain=True,
    )
    assert {"mlx_matmul", "hf2q_small_mm", "hf2q_small_mm(2, 4, 1)"} <= set(kinds)
    for name in (
        "mlx_matmul",
        "hf2q_small_mm",
        "hf2q_small_mm(2, 4, 1)",
        "hf2q_small_mm(2, 4, 1, 2)",
    ):
        got = kinds[name]()[-1].astype(mx.float32)
        assert mx.allclose(got, want, rtol=0.03, atol=0.03 * mx.abs(want).max().item()), name
    alone = node_cost._kinds(x, ws, False, False)["mlx_matmul"]()
    assert all(mx.allclose(y, x @ w.T) for y, w in zip(alone, ws))
    chained = node_cost._kinds(x, ws, False, False, chain=True)["add"]()
    assert mx.allclose(chained[-1], x[:, :1] + sum(w[:20] for w in ws))
