"""The small-M kernel's dequantizing variant (cuda_matmul.small_qmatmul_cuda) and its dispatch.

Why it exists: MLX's quantized product computes a row differently at different row counts on
CUDA (benchmarks/quant_rows.py, session 34 on the H200: rows of a 16-row product never equal the
one-row product's), so with it greedy DFlash on a 4- or 8-bit target parts from plain decoding.
The kernel dequantizes each weight (float32 fma, one rounding to the activations' dtype) into
the unquantized kernel's mma steps, so a row's bits do not depend on the other rows.

On this CPU the kernel source runs in the CUDA emulator (tests/cuda_emu.py); the CUDA tests run
the real kernel, and greedy DFlash on a quantized demo target against plain decoding.
"""

from __future__ import annotations

import cuda_emu
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from hf2q.errors import UsageError
from hf2q.kernels import cuda_matmul as cm
from hf2q.kernels import linear as lin
from hf2q.kernels import select

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


@pytest.fixture
def emulated(monkeypatch, tmp_path):
    """The kernel's own source (with and without the addend), run by the CPU emulator."""
    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")
    kerns = {
        add: cuda_emu.EmulatedKernel(
            "hf2q_small_qmm",
            ["x", "w", "s", "b", "r"] if add else ["x", "w", "s", "b"],
            ["y"],
            cm._QSOURCE_ADD if add else cm._QSOURCE,
            cm._QHEADER,
            workdir=tmp_path,
        )
        for add in (False, True)
    }
    monkeypatch.setattr(cm, "_qkernel", lambda add=False: kerns[add])
    return kerns


def _quantized(rows, K, N, dtype, bits, group, seed=0):
    mx.random.seed(seed)
    x = mx.random.normal((rows, K)).astype(dtype)
    w = (mx.random.normal((N, K)) * K**-0.5).astype(dtype)
    return x, mx.quantize(w, group_size=group, bits=bits)


def _dequantized(q, bits, group) -> np.ndarray:
    """The kernel's weights: fma(scale, q, bias) in float32 (exact in float64, rounded once),
    then rounded to the scales' dtype, as float64."""
    wq, scales, biases = q
    packed = np.array(wq).astype(np.uint64)
    per = 32 // bits
    shifts = (bits * np.arange(per)).astype(np.uint64)
    vals = (packed[:, :, None] >> shifts) & np.uint64((1 << bits) - 1)
    vals = vals.reshape(packed.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group, axis=1)
    w32 = mx.array((s * vals + b).astype(np.float32))
    return np.array(w32.astype(scales.dtype).astype(mx.float32), dtype=np.float64)


def _assert_rounded_product(y, x, wf):
    """y is x @ wf.T rounded once to its dtype (float32 summation error far below that)."""
    ref = np.array(x.astype(mx.float32), dtype=np.float64) @ wf.T
    got = np.array(y.astype(mx.float32), dtype=np.float64)
    ulp = 2.0**-8 if y.dtype == mx.bfloat16 else 2.0**-11
    assert got.shape == ref.shape
    assert np.all(np.abs(got - ref) <= ulp * np.abs(ref) + 1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    "bits,group,dtype",
    [(4, 64, mx.bfloat16), (8, 64, mx.bfloat16), (4, 32, mx.float16), (8, 128, mx.float16)],
    ids=["4bit-g64-bf16", "8bit-g64-bf16", "4bit-g32-fp16", "8bit-g128-fp16"],
)
def test_emulated_kernel_computes_the_dequantized_product(emulated, bits, group, dtype):
    x, q = _quantized(19, 256, 48, dtype, bits, group)
    assert cm.quantized_supported(x, *q, bits, group) is None
    y = cm.small_qmatmul_cuda(x, *q, bits=bits, group=group)
    assert y.dtype == dtype and y.shape == (19, 48)
    _assert_rounded_product(y, x, _dequantized(q, bits, group))
    # ... which is MLX's dequantization (up to the weights' rounding to the dtype)
    deq = mx.dequantize(*q, group_size=group, bits=bits).astype(mx.float32)
    want = x.astype(mx.float32) @ deq.T
    assert mx.allclose(y.astype(mx.float32), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_emulated_rows_have_the_same_bits_at_every_row_count(emulated, bits):
    # What lossless DFlash needs: a verify row (one of 16, of 40 over three m-tiles) is the
    # decode step's product (one row) bit for bit.
    x, q = _quantized(40, 512, 32, mx.bfloat16, bits, 64, seed=3)
    many = cm.small_qmatmul_cuda(x, *q, bits=bits, group=64)
    block = cm.small_qmatmul_cuda(x[:16], *q, bits=bits, group=64)
    ones = [cm.small_qmatmul_cuda(x[i : i + 1], *q, bits=bits, group=64) for i in (0, 7, 15)]
    assert mx.array_equal(block, many[:16])
    for i, one in zip((0, 7, 15), ones):
        assert mx.array_equal(one[0], block[i])
    # leading axes as a verify passes them (batch, rows, K)
    assert mx.array_equal(cm.small_qmatmul_cuda(x[None, :16], *q, bits=bits, group=64)[0], block)


def test_emulated_residual_in_the_launch_has_the_bits_of_the_two_steps(emulated):
    x, q = _quantized(5, 256, 64, mx.bfloat16, 4, 64, seed=8)
    r = mx.random.normal((5, 64)).astype(mx.bfloat16)
    y = cm.small_qmatmul_cuda(x, *q, bits=4, group=64)
    assert mx.array_equal(cm.small_qmatmul_cuda(x, *q, bits=4, group=64, add=r), y + r)
    with pytest.raises(ValueError, match="addend"):
        cm.small_qmatmul_cuda(x, *q, bits=4, group=64, add=r[:, :32])


def test_quantized_supported_names_what_it_cannot_do():
    x, q = _quantized(2, 128, 16, mx.bfloat16, 4, 64)
    wq, s, b = q
    assert cm.quantized_supported(x, wq, s, b, 4, 64) is None
    assert "float32" in cm.quantized_supported(x.astype(mx.float32), wq, s, b, 4, 64)
    assert "affine" in cm.quantized_supported(x, wq, s, None, 4, 64)
    assert "2-bit" in cm.quantized_supported(x, wq, s, b, 2, 64)
    assert "do not multiply" in cm.quantized_supported(x[:, :64], wq, s, b, 4, 64)
    assert "scales" in cm.quantized_supported(x, wq, s[:, :1], b[:, :1], 4, 64)
    x3, q3 = _quantized(2, 96, 16, mx.bfloat16, 4, 32)
    assert "K=96" in cm.quantized_supported(x3, *q3, 4, 32)
    x4, q4 = _quantized(2, 128, 12, mx.bfloat16, 4, 64)
    assert "N=12" in cm.quantized_supported(x4, *q4, 4, 64)
    big = mx.zeros((cm.MAX_ROWS + 1, 128), dtype=mx.bfloat16)
    assert "rows" in cm.quantized_supported(big, wq, s, b, 4, 64)


def _qlinear(K, N, bits=4, group=64, bias=False, seed=0):
    mx.random.seed(seed)
    lin_mod = nn.Linear(K, N, bias=bias)
    lin_mod.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(lin_mod, group_size=group, bits=bits)
    mx.eval(q.parameters())
    return q


def _close_to_dequantized(y, q, x):
    """``y`` is ``x`` times ``q``'s dequantized weight to bf16 precision (MLX's CPU quantized
    product in bf16 is itself off by a few percent, so the float32 product is the reference)."""
    deq = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits)
    want = x.astype(mx.float32) @ deq.astype(mx.float32).T
    if "bias" in q:
        want = want + q.bias.astype(mx.float32)
    return mx.allclose(y.astype(mx.float32), want, rtol=2e-2, atol=2e-2).item()


def test_linear_runs_quantized_layers_on_the_kernel_where_the_switch_says(emulated, monkeypatch):
    calls = []
    real = cm.small_qmatmul_cuda

    def counting(x, *args, **kw):
        calls.append((x.shape, kw.get("add") is not None))
        return real(x, *args, **kw)

    monkeypatch.setattr(cm, "small_qmatmul_cuda", counting)
    monkeypatch.setattr(select, "small_qmm_enabled", lambda: True)
    monkeypatch.setattr(select, "grouped_mm_enabled", lambda: True)
    x = mx.random.normal((5, 128)).astype(mx.bfloat16)
    q = _qlinear(128, 32)
    want = q(x)
    # off: MLX's own product, untouched
    assert mx.array_equal(lin.linear(q, x, False), want) and not calls
    y = lin.linear(q, x, True)
    assert calls == [((5, 128), False)]
    assert _close_to_dequantized(y, q, x)
    # a residual joins the launch, with the bits of the product plus the addend
    r = mx.random.normal((5, 32)).astype(mx.bfloat16)
    assert mx.array_equal(lin.linear(q, x, True, add=r), y + r) and calls[-1][1]
    # a bias is added after the product, as nn.QuantizedLinear adds it
    qb = _qlinear(128, 32, bias=True, seed=1)
    yb = lin.linear(qb, x, True)
    assert mx.array_equal(yb, lin.linear(qb, x, True, add=None))
    assert _close_to_dequantized(yb, qb, x)
    # the switch off: MLX's product again
    n = len(calls)
    monkeypatch.setattr(select, "small_qmm_enabled", lambda: False)
    assert mx.array_equal(lin.linear(q, x, True), want) and len(calls) == n
    # float32 scales (a float32 model) and other modes stay on MLX's product
    monkeypatch.setattr(select, "small_qmm_enabled", lambda: True)
    q32 = nn.QuantizedLinear.from_linear(nn.Linear(128, 32, bias=False), group_size=64, bits=4)
    assert mx.array_equal(lin.linear(q32, x, True), q32(x)) and len(calls) == n


def test_narrow_quantized_layers_run_padded_and_keep_their_columns(emulated, monkeypatch):
    # A small model's Gated-DeltaNet gate projections are 4 wide: the kernel takes multiples of
    # 8 columns, so zero rows are appended once (kept on the module) and 4 columns kept.
    monkeypatch.setattr(select, "small_qmm_enabled", lambda: True)
    x = mx.random.normal((3, 256)).astype(mx.bfloat16)
    q = _qlinear(256, 4, seed=2)
    y = lin.linear(q, x, True)
    assert y.shape == (3, 4)
    assert _close_to_dequantized(y, q, x)
    first = q.__dict__["_hf2q_qpadded"]
    assert first[1][0].shape == (8, 256 * 4 // 32)
    lin.linear(q, x[:1], True)
    assert q.__dict__["_hf2q_qpadded"] is first  # padded once, not per call
    assert mx.array_equal(lin.linear(q, x[:1], True)[0], y[0])  # and row-invariant


def test_a_4bit_draft_head_runs_on_the_kernel_in_bf16_and_as_one_product_off_it(
    emulated, monkeypatch, fitted_pairs
):
    # TargetModel.draft_head(4): a bf16 draft's rows on the dequantizing kernel where it runs;
    # a float32 draft (which the kernel does not take) on MLX's product of all rows at once,
    # never a batched product a slot (the path session 50's failing GPU test took).
    from conftest import load_fitted

    monkeypatch.setattr(select, "small_qmm_enabled", lambda: True)
    for dtype in (mx.bfloat16, mx.float32):
        _, target, _ = load_fitted(*fitted_pairs["qwen35"])
        target.model.set_dtype(dtype)
        head = target.draft_head(4)
        q = target._quantized_head(4)  # the copy the draft head reads (made once, kept)
        assert q.scales.dtype == dtype
        h = mx.random.normal((2, 15, target.hidden_size)).astype(dtype)
        flat = h.reshape(-1, h.shape[-1])
        got = head(h, True)  # the drafter's mm where the head's rows take the kernel
        assert got.shape == (2, 15, q.weight.shape[0])
        if dtype == mx.bfloat16:
            want = cm.small_qmatmul_cuda(
                flat, q.weight, q.scales, q.biases, bits=4, group=q.group_size
            )
        else:
            assert not lin.quantized_fits(q, h)
            want = q(flat)
        assert mx.array_equal(got.reshape(flat.shape[0], -1), want)


def test_a_4bit_draft_vocabularys_rows_run_on_the_kernel_in_bf16(
    emulated, monkeypatch, fitted_pairs
):
    # TargetModel.draft_head(4, vocab): the 4-bit rows of the draft vocabulary on the
    # dequantizing kernel where the draft's rows take it (widened to the vocabulary by a sampled
    # draft).
    from conftest import load_fitted

    monkeypatch.setattr(select, "small_qmm_enabled", lambda: True)
    _, target, _ = load_fitted(*fitted_pairs["qwen35"])
    target.model.set_dtype(mx.bfloat16)
    head = target.draft_head(4, 100)
    q = target._vocab_rows(100, 4)
    assert q.bits == 4 and q.weight.shape[0] == 128 and q.scales.dtype == mx.bfloat16
    h = mx.random.normal((1, 15, target.hidden_size)).astype(mx.bfloat16)
    flat = h.reshape(-1, h.shape[-1])
    got = head(h, True)
    assert got.shape == (1, 15, 128)  # the ids' columns (a sampled draft widens them)
    ids = mx.array(target.draft_vocab_ids(100))
    want = cm.small_qmatmul_cuda(flat, q.weight, q.scales, q.biases, bits=4, group=q.group_size)
    assert mx.array_equal(got[0], want)
    assert mx.array_equal(head.widen(got)[0][:, ids], want)


def test_quantized_tied_head_runs_on_the_kernel(emulated, monkeypatch):
    monkeypatch.setattr(select, "small_qmm_enabled", lambda: True)
    emb = nn.Embedding(64, 128)
    emb.set_dtype(mx.bfloat16)
    qe = nn.QuantizedEmbedding.from_embedding(emb, group_size=64, bits=8)
    x = mx.random.normal((2, 128)).astype(mx.bfloat16)
    y = lin.head(qe, x, True)
    _assert_rounded_product(y, x, _dequantized((qe.weight, qe.scales, qe.biases), 8, 64))
    assert mx.array_equal(lin.head(qe, x, False), qe.as_linear(x))
    assert mx.array_equal(lin.head(qe, x, lin.FROZEN), qe.as_linear(x))  # the drafter's head


def test_quantized_kernel_switch_is_cuda_only_and_reported(monkeypatch):
    monkeypatch.setenv(select.SMALL_QMM_ENV, "1")
    if select.backend() == "cuda":
        assert select.small_qmm_enabled()
        assert "dequantized in the kernel" in select.describe()["small_mm"]
        key = select.mm_key()
        monkeypatch.setenv(select.SMALL_QMM_ENV, "0")
        assert not select.small_qmm_enabled() and select.mm_key() != key
        monkeypatch.setenv(select.SMALL_QMM_ENV, "sometimes")
        with pytest.raises(UsageError, match="HF2Q_SMALL_QMM"):
            select.small_qmm_enabled()
    else:
        assert not select.small_qmm_enabled()
        assert "dequantized" not in select.describe()["small_mm"]


def test_launch_setting_keeps_the_warps_and_fits_the_rows(monkeypatch):
    monkeypatch.delenv(cm.QMM_LAUNCH_ENV, raising=False)
    assert cm._env_launch(1, 9216) is None
    monkeypatch.setenv(cm.QMM_LAUNCH_ENV, "8x8x2")
    assert cm._env_launch(1, 9216) == (8, 8, 2)
    assert cm._env_launch(1, 32) == (4, 8, 2)  # 32 columns: four 8-column blocks at most
    # many rows (a prefill chunk, a batched verify): the default blocks, the setting's warps
    default = cm.launch_shape(64, 2560, 9216)
    assert cm._env_launch(64, 9216) == (default[1], 8, default[3])
    for bad, why in [("8x8", "NBxWARPSxUNROLL"), ("4x16x1", "1 to 8 warps")]:
        monkeypatch.setenv(cm.QMM_LAUNCH_ENV, bad)
        with pytest.raises(UsageError, match=why):
            cm._env_launch(1, 9216)


# -- on the GPU ------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K,N", [(2560, 9216), (9216, 2560), (2560, 32), (2560, 248320)])
def test_cuda_kernel_computes_the_dequantized_product_with_row_invariant_bits(K, N, bits):
    x, q = _quantized(128, K, N, mx.bfloat16, bits, 64, seed=K + N)
    full = cm.small_qmatmul_cuda(x, *q, bits=bits, group=64)
    if N * K < 1e8:  # (the head's float64 reference would take minutes)
        _assert_rounded_product(full, x, _dequantized(q, bits, 64))
    deq = mx.dequantize(*q, group_size=64, bits=bits).astype(mx.float32)
    want = x.astype(mx.float32) @ deq.T
    assert mx.allclose(full.astype(mx.float32), want, rtol=2e-2, atol=2e-2)
    for rows in (1, 2, 16, 17, 48, 64):
        assert mx.array_equal(cm.small_qmatmul_cuda(x[:rows], *q, bits=bits, group=64), full[:rows])


@cuda_only
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_greedy_dflash_on_a_quantized_target_equals_plain(bits):
    # The embedded demo pair with its target quantized in place (bf16 activations): every verify
    # row computed as its decode step, so greedy DFlash keeps plain decoding's tokens exactly,
    # single and batched (with MLX's quantized product it did not: session 34).
    from conftest import assert_greedy_dflash_equals_plain

    from hf2q.runtime.pair import load_pair

    pair = load_pair(None)
    nn.quantize(pair.target.model, group_size=64, bits=bits)
    mx.eval(pair.target.model.parameters())
    pair.drafter.bind(pair.target.embed, pair.target.head)
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]
    prompts = [pair.tokenizer.encode(t) for t in texts]
    assert_greedy_dflash_equals_plain(
        pair.target, pair.drafter, prompts, [48, 40, 56], blocks=[16, 4], slots=3
    )
