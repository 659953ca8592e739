"""The row-invariant attention kernel (hf2q/kernels/cuda_attention.py) and its use by the runners.

On this CPU the kernel's own source runs in the CUDA emulator (tests/cuda_emu.py): that checks its
indexing, tiling, online softmax, warp merge and stores against a float64 attention, that a query
row's bits do not depend on how many rows one call computes, and that the compiled attention
runner with it gives a verify block whose every row equals the plain decode step of that token,
bit for bit in bf16. The CUDA tests run the real kernel.
"""

from __future__ import annotations

import checkpoints as ck
import cuda_emu
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import assert_switch_keeps_demo_logits
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from hf2q.errors import UsageError
from hf2q.kernels import cuda_attention as ca
from hf2q.kernels import select
from hf2q.kernels.attention import reads_buffer_in_place
from hf2q.kernels.layers import fast_layer_fn
from hf2q.runtime.cache import BucketedKVCache, TargetCache, make_target_cache
from hf2q.runtime.slot_cache import SlotKVCache
from hf2q.runtime.target import TargetModel
from hf2q.runtime.verify import runner_verify_layer_fn

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


@pytest.fixture(scope="module")
def _emulated_kernels(tmp_path_factory):
    """The kernels' own sources built once for the module by the CPU emulator."""
    if HAS_CUDA or cuda_emu.compiler() is None:
        return None
    workdir = tmp_path_factory.mktemp("row_attention_emu")
    return {
        kind: cuda_emu.EmulatedKernel(name, ins, outs, src, header, workdir=workdir)
        for kind, (name, ins, outs, src, header) in ca.SPECS.items()
    }


@pytest.fixture
def emulated(monkeypatch, _emulated_kernels):
    """The kernels' own sources, run by the CPU emulator in place of MLX's CUDA backend."""
    if HAS_CUDA:
        return None  # the real kernels
    if _emulated_kernels is None:
        pytest.skip("no C++ compiler for the CUDA emulator")
    monkeypatch.setattr(ca, "_kernel", lambda kind="whole": _emulated_kernels[kind])
    return True


def _inputs(B, nq, nkv, L, D, C, dtype, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, nq, L, D)).astype(dtype)
    k = mx.random.normal((B, nkv, C, D)).astype(dtype)
    v = mx.random.normal((B, nkv, C, D)).astype(dtype)
    return q, k, v


def _reference(q, k, v, first, scale, window=None, causal=True):
    """float64 attention of the (rounded) inputs, (B, L, nq, D); row i of batch row b sits at
    position first[b] + i (``causal=False``: it sees the whole block)."""
    qf, kf, vf = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    B, nq, L, D = qf.shape
    G = nq // kf.shape[1]
    out = np.zeros((B, L, nq, D))
    first = [int(f) for f in np.array(first).reshape(-1)]
    for b in range(B):
        for i in range(L):
            pos = first[b if len(first) > 1 else 0] + i
            hi = pos + 1 if causal else pos - i + L
            lo = max(0, pos + 1 - window) if window else 0
            for h in range(nq):
                s = kf[b, h // G, lo:hi] @ qf[b, h, i] * scale
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ vf[b, h // G, lo:hi]
    return out


CASES = [
    # B, nq, nkv, L, D, C, first positions, window (negative: the same, not causal)
    (1, 8, 2, 3, 64, 100, [70], None),  # GQA group 4 (the demo's), tiles split over warps
    (2, 4, 4, 2, 32, 70, [5, 40], None),  # no grouping; ragged rows
    (1, 4, 2, 1, 128, 300, [290], None),  # one decode row over two chunks (merge launch)
    (2, 4, 2, 3, 64, 520, [100, 500], None),  # ragged rows: one chunk and two chunks
    (1, 4, 1, 4, 64, 128, [100], 16),  # sliding window, a key group starts inside the window
    (1, 8, 1, 2, 256, 80, [60], None),  # group 8 of 256: four warps (the merge buffer's limit)
    (2, 4, 2, 5, 64, 300, [20, 270], 0),  # not causal (a draft block), ragged, one and two chunks
    (1, 4, 2, 6, 32, 64, [30], -8),  # not causal, sliding window
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_kernel_computes_causal_attention(emulated, case, dtype):
    B, nq, nkv, L, D, C, first, window = case
    causal = window is None or window > 0
    window = abs(window) if window else None
    q, k, v = _inputs(B, nq, nkv, L, D, C, dtype)
    off = mx.array(first, dtype=mx.int32)
    out = ca.row_attention_cuda(q, k, v, off, D**-0.5, window=window, causal=causal)
    assert out.shape == (B, L, nq, D) and out.dtype == dtype
    ref = _reference(q, k, v, off, D**-0.5, window, causal)
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    ulp = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    # One rounding of a float32 result (its own error is far below that).
    assert np.all(np.abs(got - ref) <= ulp * np.abs(ref) + 1e-5 * np.abs(ref).max())


def test_kernel_row_bits_do_not_depend_on_the_rows_computed_with_it(emulated):
    B, nq, nkv, L, D = 1, 4, 1, 5, 64  # one KV head of the 4B's group of four (emulator time)
    for first in (120, ca.CHUNK - 2):  # the single launch; rows across a chunk boundary
        C = 160 if first == 120 else ca.CHUNK + 16
        q, k, v = _inputs(B, nq, nkv, L, D, C, mx.bfloat16, seed=1)
        block = ca.row_attention_cuda(q, k, v, mx.array([first]), 0.125)
        for i in (0, L - 1):
            alone = ca.row_attention_cuda(q[:, :, i : i + 1], k, v, mx.array([first + i]), 0.125)
            assert mx.array_equal(alone[:, 0], block[:, i])


def test_one_chunk_rows_get_the_same_bits_from_either_launch(emulated):
    """A row whose keys fit one chunk: the single launch (cache of <= CHUNK positions) and the
    chunked pair (a longer buffer, as after the cache grew) write the same bits."""
    q, k, v = _inputs(1, 4, 1, 4, 64, 2 * ca.CHUNK, mx.bfloat16, seed=2)
    off = mx.array([ca.CHUNK - 4])
    short = ca.row_attention_cuda(q, k[:, :, : ca.CHUNK], v[:, :, : ca.CHUNK], off, 0.125)
    long = ca.row_attention_cuda(q, k, v, off, 0.125)
    assert mx.array_equal(short, long)


def _sigmoid_gate(o: mx.array, g: mx.array) -> np.ndarray:
    """``o * sigmoid(g)`` as MLX's CUDA elementwise kernels compute it in o's 16-bit dtype (every
    intermediate rounded; the sigmoid ``1 / (1 + exp(|g|))``, mirrored for g >= 0), in numpy."""
    dt = o.dtype

    def r(a):
        return np.array(mx.array(np.asarray(a, np.float32)).astype(dt).astype(mx.float32))

    gf = np.array(g.astype(mx.float32))
    e = np.exp(np.abs(gf).astype(np.float64)).astype(np.float32)
    y = r(1.0 / r(1.0 + r(e)))
    return r(np.array(o.astype(mx.float32)) * np.where(gf < 0, y, r(1.0 - y)))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("C,first", [(100, [70, 20]), (300, [290, 100])], ids=["whole", "chunks"])
def test_gated_store_is_the_attention_times_mlx_sigmoid_of_the_gate(emulated, dtype, C, first):
    # The gate read from a q projection's output (each head's queries, then its gate: layout
    # (2 D, D)): the gated launch writes MLX's o * sigmoid(gate) of the ungated launch's o, in
    # the single launch and in the chunked pair's merge.
    B, nq, nkv, L, D = 2, 4, 2, 3, 64
    q, k, v = _inputs(B, nq, nkv, L, D, C, dtype, seed=C)
    q_out = (mx.random.normal((B, L, nq * 2 * D)) * 3).astype(dtype)
    off = mx.array(first, dtype=mx.int32)
    plain = ca.row_attention_cuda(q, k, v, off, D**-0.5)
    gated = ca.row_attention_cuda(q, k, v, off, D**-0.5, gate=q_out, gate_layout=(2 * D, D))
    gate = q_out.reshape(B, L, nq, 2 * D)[..., D:]
    assert gated.shape == plain.shape and gated.dtype == dtype
    assert np.array_equal(np.array(gated.astype(mx.float32)), _sigmoid_gate(plain, gate))


def test_heads_a_block_change_no_bit(emulated, monkeypatch):
    """HF2Q_ATTN_HEADS splits a KV head's query heads over blocks: every head's work and its order
    stay the same, so a decode row and a verify block's rows keep their bits at every setting."""
    q, k, v = _inputs(1, 4, 1, 3, 64, ca.CHUNK + 16, mx.bfloat16, seed=5)
    off = mx.array([ca.CHUNK - 2])
    got = {}
    # C None: the whole buffer (keys in two chunks, the part and merge launches); 160: one launch
    for heads, causal, C in [
        ("4", True, None),
        ("1", True, None),
        ("4", False, 160),
        ("2", False, 160),
    ]:
        monkeypatch.setenv(ca.HEADS_ENV, heads)
        got[heads, causal] = ca.row_attention_cuda(
            q, k[:, :, :C], v[:, :, :C], off if C is None else mx.array([150]), 0.125, causal=causal
        )
    assert mx.array_equal(got["1", True], got["4", True])
    assert mx.array_equal(got["2", False], got["4", False])
    monkeypatch.setenv(ca.HEADS_ENV, "3")
    assert ca.heads_per_block(4) == 2 and ca.heads_per_block(6) == 3
    monkeypatch.delenv(ca.HEADS_ENV)
    assert ca.heads_per_block(4) == 2 and ca.heads_per_block(1) == 1
    for bad in ("many", "0"):
        monkeypatch.setenv(ca.HEADS_ENV, bad)
        with pytest.raises(UsageError, match=f"{ca.HEADS_ENV}=.* unset it or fix it"):
            ca.heads_per_block(4)


def test_warps_depend_on_head_sizes_only():
    assert ca.warps(4, 256) == ca.WARPS  # the 4B's attention
    assert ca.warps(4, 64) == ca.WARPS  # the demo's
    assert ca.warps(8, 256) == ca.WARPS // 2


def test_supported_names_what_it_cannot_do():
    q, k, v = _inputs(1, 4, 2, 1, 64, 8, mx.bfloat16)
    assert ca.supported(q, k, v) is None
    assert "bf16 or fp16" in ca.supported(q.astype(mx.float32), k, v)
    q48, k48, v48 = _inputs(1, 4, 2, 1, 48, 8, mx.bfloat16)
    assert "multiple of 32" in ca.supported(q48, k48, v48)
    q3, k3, v3 = _inputs(1, 6, 4, 1, 64, 8, mx.bfloat16)
    assert "query heads" in ca.supported(q3, k3, v3)


def test_which_caches_are_read_in_place():
    assert reads_buffer_in_place(KVCache())
    assert reads_buffer_in_place(BucketedKVCache(256))
    assert reads_buffer_in_place(SlotKVCache(2))
    assert not reads_buffer_in_place(RotatingKVCache(max_size=8))
    assert not reads_buffer_in_place(QuantizedKVCache())
    assert not reads_buffer_in_place(None)


def test_selection_is_cuda_only_and_reported(monkeypatch):
    monkeypatch.delenv(select.ROW_ATTENTION_ENV, raising=False)
    assert select.row_attention_enabled() == (select.backend() == "cuda")
    assert "attention " in select.summary()
    monkeypatch.setenv(select.ROW_ATTENTION_ENV, "0")
    assert not select.row_attention_enabled()
    assert "MLX attention" in select.summary()
    monkeypatch.setenv(select.ROW_ATTENTION_ENV, "maybe")
    with pytest.raises(UsageError, match="HF2Q_ROW_ATTENTION"):
        select.row_attention_enabled()


def _target(dtype, head_dim: int = 32) -> TargetModel:
    # head_dim 32: the kernel needs a multiple of 32 (the tiny fixtures use 16); 64 for the norm
    # + RoPE launch (a quarter of the head rotated: 16 values, the launch's least).
    args = qwen3_5.TextModelArgs(**dict(ck.TINY_TEXT_ARGS, head_dim=head_dim))
    mx.random.seed(7)
    model = qwen3_5.TextModel(args)
    model.set_dtype(dtype)
    return TargetModel(model)


PROMPT = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9]
TOKENS = [3, 23, 8, 46, 2, 6]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("gate", ["0", "1"], ids=["gate-after", "gate-in-launch"])
def test_runner_with_the_kernel_equals_mlx_attention(emulated, dtype, gate, monkeypatch):
    """The full-attention runner with the kernel against MLX's attention (prefill + 3 decodes),
    with the output gate after the launch and in it (``HF2Q_ATTN_GATE``)."""
    monkeypatch.setenv(select.ATTN_GATE_ENV, gate)
    target = _target(dtype)
    outs = []
    for rows in (False, True):
        cache = make_prompt_cache(target.model)
        fn = fast_layer_fn(rows=rows)
        logits = [target.forward(mx.array([PROMPT]), cache, layer_fn=fn)[0]]
        for t in TOKENS[:3]:
            logits.append(target.forward(mx.array([[t]]), cache, layer_fn=fn)[0])
        outs.append(mx.concatenate(logits, axis=1).astype(mx.float32))
    if dtype == mx.float32:  # the kernel takes half precision only: float32 stays MLX's
        assert mx.array_equal(outs[0], outs[1])
    else:
        assert mx.allclose(outs[0], outs[1], rtol=5e-2, atol=5e-2)
        assert mx.array_equal(mx.argmax(outs[0], -1), mx.argmax(outs[1], -1))


def _verify_and_steps(target: TargetModel) -> tuple[mx.array, ...]:
    """A verify block of ``TOKENS`` after ``PROMPT`` through the runners (kernel attention,
    keys padded to a bucket as on CUDA: the kernel must ignore the padding), and the same
    tokens as plain decode steps (kernel attention, mlx-lm's KVCache): ``(verify logits, verify
    features of every layer, steps' logits, steps' features)``."""
    capture = list(range(target.num_layers))
    prompt, block = mx.array([PROMPT]), mx.array([TOKENS])
    cache = TargetCache(
        BucketedKVCache(256) if type(c) is KVCache else c for c in make_target_cache(target.model)
    )
    step = fast_layer_fn(rows=True)
    target.forward(prompt, cache, layer_fn=step)
    cache.begin_verify(block.shape[1])
    logits_v, feats_v = target.forward(
        block, cache, capture=capture, layer_fn=runner_verify_layer_fn(rows=True)
    )
    plain = make_prompt_cache(target.model)
    target.forward(prompt, plain, layer_fn=step)
    outs = [
        target.forward(block[:, i : i + 1], plain, capture=capture, layer_fn=step)
        for i in range(block.shape[1])
    ]
    logits_d = mx.concatenate([o[0] for o in outs], axis=1)
    return logits_v, feats_v, logits_d, mx.concatenate([o[1] for o in outs], axis=1)


@pytest.mark.parametrize("gate", ["0", "1"], ids=["gate-after", "gate-in-launch"])
def test_verify_rows_equal_decode_steps_bit_for_bit_through_the_runners(
    emulated, gate, monkeypatch
):
    """bf16: a verify block through the runners and the same tokens as plain decode steps,
    every layer, every row; with the output gate after the launch and in it
    (``HF2Q_ATTN_GATE``)."""
    monkeypatch.setenv(select.ATTN_GATE_ENV, gate)
    logits_v, feats_v, logits_d, feats_d = _verify_and_steps(_target(mx.bfloat16))
    assert mx.array_equal(feats_v, feats_d)
    assert mx.array_equal(logits_v, logits_d)


def test_slot_rows_at_different_positions_equal_their_single_runs(emulated):
    """Two slots holding different lengths (ragged offsets) through the runner with the kernel:
    each row's decode step equals that sequence decoded alone, bit for bit (bf16)."""
    from hf2q.runtime.slot_cache import make_slot_target_cache

    target = _target(mx.bfloat16)
    step = fast_layer_fn(rows=True)
    prompts = [PROMPT, PROMPT[:7]]
    singles = []
    for p in prompts:
        c = make_prompt_cache(target.model)
        target.forward(mx.array([p]), c, layer_fn=step)
        singles.append(c)
    batched = make_slot_target_cache(target, 2)
    for row, c in enumerate(singles):
        batched.insert(row, c)
    nxt = mx.array([[TOKENS[0]], [TOKENS[1]]])
    both, _ = target.forward(nxt, batched, layer_fn=step)
    for row, c in enumerate(singles):
        alone, _ = target.forward(nxt[row : row + 1], c, layer_fn=step)
        assert mx.array_equal(both[row], alone[0])


@cuda_only
def test_cuda_kernel_row_is_the_decode_step_at_the_4b_shape():
    """The 4B shape (16 query / 4 KV heads of 256) at 1024 positions: one rounding of float64,
    and a row alone gives the bits it has inside a 16-row verify block."""
    q, k, v = _inputs(1, 16, 4, 16, 256, 1280, mx.bfloat16, seed=3)
    block = ca.row_attention_cuda(q, k, v, mx.array([1008]), 256**-0.5)
    ref = _reference(q, k, v, mx.array([1008]), 256**-0.5)
    got = np.array(block.astype(mx.float32), dtype=np.float64)
    assert np.all(np.abs(got - ref) <= 2.0**-8 * np.abs(ref) + 1e-5 * np.abs(ref).max())
    alone = ca.row_attention_cuda(q[:, :, 9:10], k, v, mx.array([1017]), 256**-0.5)
    assert mx.array_equal(alone[:, 0], block[:, 9])


@pytest.fixture
def emulated_norm_rope(monkeypatch, tmp_path, emulated):
    """The norm + RoPE launch's own source (emulated here, real on CUDA) with the row attention
    kernel; its launches counted in the returned list. (Emulated, the compiled pieces that call
    it run untraced: the emulator reads its inputs; on a GPU, traced.)"""
    from hf2q.kernels import cuda_norm as cn

    launches: list[int] = []
    if HAS_CUDA:
        real = cn._rope_kernel
    else:

        def real(eps, base, scale):
            src = cn.rope_source(eps, base, scale)
            ins, outs = ["x", "w", "off"], ["out"]
            return cuda_emu.EmulatedKernel("hf2q_norm_rope", ins, outs, src, cn._HEADER, tmp_path)

    def counted(*a):
        launches.append(1)
        return real(*a)

    monkeypatch.setattr(cn, "_rope_kernel", counted)
    monkeypatch.setenv(select.NORM_ROPE_ENV, "1")
    if not HAS_CUDA:
        mx.disable_compile()
    try:
        yield launches
    finally:
        mx.enable_compile()


@pytest.mark.parametrize("gate", ["0", "1"], ids=["gate-after", "gate-in-launch"])
def test_verify_rows_equal_decode_steps_with_norm_and_rope_in_one_launch(
    emulated_norm_rope, gate, monkeypatch
):
    """bf16, ``HF2Q_NORM_ROPE=1``: a verify block through the runners and the same tokens as
    plain decode steps, every layer and row bit for bit (queries and keys from the launch at
    each row's position), and close to MLX's own norm and RoPE."""
    monkeypatch.setenv(select.ATTN_GATE_ENV, gate)
    target = _target(mx.bfloat16, head_dim=64)
    logits_v, feats_v, logits_d, feats_d = _verify_and_steps(target)
    assert emulated_norm_rope  # the attention layers' queries and keys came from the launch
    assert mx.array_equal(feats_v, feats_d)
    assert mx.array_equal(logits_v, logits_d)
    monkeypatch.setenv(select.NORM_ROPE_ENV, "0")
    step = fast_layer_fn(rows=True)
    ops = make_prompt_cache(target.model)
    target.forward(mx.array([PROMPT]), ops, layer_fn=step)
    want = [target.forward(mx.array([[t]]), ops, layer_fn=step)[0] for t in TOKENS]
    want = mx.concatenate(want, axis=1).astype(mx.float32)
    assert mx.allclose(logits_v.astype(mx.float32), want, rtol=5e-2, atol=5e-2)


@cuda_only
@pytest.mark.parametrize("C", [1280, 200], ids=["chunks", "whole"])
def test_cuda_gated_store_has_the_bits_of_mlx_multiply(C):
    # The 4B shape: the gated launch equals MLX's own o * sigmoid(gate) after the ungated one.
    q, k, v = _inputs(1, 16, 4, 16, 256, C, mx.bfloat16, seed=4)
    q_out = (mx.random.normal((1, 16, 16 * 512)) * 3).astype(mx.bfloat16)
    off = mx.array([C - 16])
    plain = ca.row_attention_cuda(q, k, v, off, 256**-0.5)
    gated = ca.row_attention_cuda(q, k, v, off, 256**-0.5, gate=q_out, gate_layout=(512, 256))
    gate = q_out.reshape(1, 16, 16, 512)[..., 256:]
    assert mx.array_equal(gated, plain * mx.sigmoid(gate))


@cuda_only
def test_cuda_runners_give_the_same_logits_with_the_gate_in_the_launch(monkeypatch):
    assert_switch_keeps_demo_logits(monkeypatch, select.ATTN_GATE_ENV, rows=True)


# -- the drafter's fast layer path (compiled pieces around the kernel) ----------------------------


def _drafter(**overrides):
    from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel

    # Two query heads on one KV head: the kernel's grouped path at half the emulated blocks of
    # the fixtures' 4/2 heads (6-7 s a test alone on this CPU before, 2.5-3.5 s now).
    heads = dict(num_attention_heads=2, num_key_value_heads=1)
    cfg = DFlashConfig.from_dict(ck.drafter_config(head_dim=32, layers=2, **heads, **overrides))
    mx.random.seed(11)
    drafter = DFlashDraftModel(cfg)
    drafter.set_dtype(mx.bfloat16)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    embed.set_dtype(mx.bfloat16)
    head.set_dtype(mx.bfloat16)
    mx.eval(drafter.parameters(), embed.parameters(), head.parameters())
    return drafter.bind(embed, head)


def _draft_rounds(drafter, caches, fast, ctx_rows, rows=1, prepare=None):
    """Drafting rounds (new context rows ``ctx_rows[r]``; slot rows prepared with
    ``prepare[r]``): the hidden states of each, through the fast layers or the layer calls
    (``fast``), or, ``fast`` a :class:`~hf2q.runtime.draft_graph.CompiledDraft` or None, the
    logits of ``drafter(...)`` through it (None: the layer path)."""
    mx.random.seed(5)
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    outs = []
    for r, S in enumerate(ctx_rows):
        feats = (mx.random.normal((rows, S, F)) * 0.5).astype(mx.bfloat16)
        block = mx.concatenate(
            [mx.full((rows, 1), 3 + r), mx.full((rows, 7), drafter.mask_token_id)], axis=1
        ).astype(mx.int32)
        if prepare is not None:
            for c in caches:
                c.prepare(lengths=prepare[r])
        if isinstance(fast, bool):
            out = drafter.hidden(block, feats, caches, fast=fast)
        else:
            out = drafter(block, feats, caches, fast)
        outs.append(out.astype(mx.float32))
        mx.eval(outs[-1], [c.state for c in caches])
    return outs


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # full attention, the block not causal (the z-lab Qwen3.5 drafters)
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    ],
)
def test_drafter_fast_layers_equal_the_layer_call(emulated, overrides):
    """Drafting through the compiled pieces and the kernel gives the hidden states of the
    layers' own calls (bf16 rounding), and leaves the cache holding the same context."""
    drafter = _drafter(**overrides)
    ref_cache, fast_cache = drafter.make_cache(), drafter.make_cache()
    ref = _draft_rounds(drafter, ref_cache, False, [5, 3, 1])
    got = _draft_rounds(drafter, fast_cache, True, [5, 3, 1])
    for a, b in zip(ref, got):
        assert mx.allclose(a, b, rtol=3e-2, atol=3e-2), float(mx.abs(a - b).max())
    for rc, fc in zip(ref_cache, fast_cache):
        assert rc.offset == fc.offset == 9
        assert mx.array_equal(rc.keys[..., :9, :], fc.keys[..., :9, :])
        assert mx.array_equal(rc.values[..., :9, :], fc.values[..., :9, :])
    # New weights (a checkpoint loaded into the same model): the compiled pieces follow them.
    mlp = drafter.layers[-1].mlp
    mlp.down_proj.weight = -mlp.down_proj.weight
    ref = _draft_rounds(drafter, ref_cache, False, [2])
    got = _draft_rounds(drafter, fast_cache, True, [2])
    assert mx.allclose(ref[0], got[0], rtol=3e-2, atol=3e-2), float(mx.abs(ref[0] - got[0]).max())


@pytest.mark.parametrize("lagged", [False, True], ids=["host-counts", "device-counts"])
def test_drafter_fast_layers_with_ragged_slot_rows(emulated, lagged):
    """Two slots appending different numbers of context rows per round (ragged offsets): the
    hidden states of the layers' own calls, and every row's kept context keys/values at their
    positions, also with the counts only on the device (lagged rounds)."""
    from hf2q.runtime.slot_cache import make_slot_draft_cache

    drafter = _drafter()
    lengths = [[5, 2], [3, 3], [1, 4]]
    ref_cache = make_slot_draft_cache(drafter, 2)
    fast_cache = make_slot_draft_cache(drafter, 2)
    for c in fast_cache:
        c.lagged = lagged
    counts = [mx.array(n, dtype=mx.int32) for n in lengths] if lagged else lengths
    ref = _draft_rounds(drafter, ref_cache, False, [5, 4, 4], rows=2, prepare=lengths)
    got = _draft_rounds(drafter, fast_cache, True, [5, 4, 4], rows=2, prepare=counts)
    for a, b in zip(ref, got):
        assert mx.allclose(a, b, rtol=3e-2, atol=3e-2), float(mx.abs(a - b).max())
    for rc, fc in zip(ref_cache, fast_cache):
        assert rc.lengths == [9, 9] and fc.offset.tolist() == [9, 9]
        for ref_buf, buf in ((rc.keys, fc.keys), (rc.values, fc.values)):
            a, b = ref_buf[..., :9, :].astype(mx.float32), buf[..., :9, :].astype(mx.float32)
            assert mx.allclose(a, b, rtol=2e-2, atol=2e-2), float(mx.abs(a - b).max())


def test_drafter_fast_path_is_chosen_where_it_applies():
    drafter = _drafter()
    layer = drafter.layers[0]
    x = mx.zeros((1, 4, drafter.config.hidden_size), dtype=mx.bfloat16)
    assert layer.fast_supported(x, KVCache())
    assert layer.fast_supported(x, SlotKVCache(2))
    assert not layer.fast_supported(x.astype(mx.float32), KVCache())
    assert not layer.fast_supported(x, RotatingKVCache(max_size=8))
    assert drafter.fast_enabled() == select.row_attention_enabled()


@pytest.mark.parametrize("lagged", [None, False, True], ids=["one", "host-counts", "device-counts"])
def test_draft_graph_with_the_kernel_equals_the_fast_layers(emulated, monkeypatch, lagged):
    """The drafter's forward as one compiled graph (``HF2Q_COMPILE_DRAFT=1``), attending with
    the row-invariant kernel, drafts the fast layers' logits bit for bit and leaves every row's
    kept context as they do: one sequence, and ragged slot rows (products over the padded
    context rows change no bit where they are row-invariant, as here). (Emulated, the graph's
    function runs without ``mx.compile``: the emulator reads its inputs; on a GPU, traced.)"""
    from hf2q.runtime.drafter import DFlashDraftModel
    from hf2q.runtime.slot_cache import make_slot_draft_cache

    monkeypatch.setattr(DFlashDraftModel, "fast_enabled", staticmethod(lambda: True))
    monkeypatch.setattr(select, "row_attention_enabled", lambda: True)
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "1")
    drafter = _drafter()
    rows = 1 if lagged is None else 2
    lengths = [[5, 2], [8, 3], [1, 8], [11, 6]] if rows == 2 else None  # (11: past a block)
    kept = [5, 8, 1, 11] if rows == 1 else [max(n) for n in lengths]

    def caches():
        made = drafter.make_cache() if rows == 1 else make_slot_draft_cache(drafter, rows)
        F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        feats = (mx.random.normal((rows, 4, F), key=mx.random.key(2)) * 0.5).astype(mx.bfloat16)
        drafter.add_context(feats, made)
        for c in made:
            c.lagged = bool(lagged)
        return made

    ref_cache, got_cache = caches(), caches()
    counts = lengths
    if lagged:
        counts = [mx.array(n, dtype=mx.int32) for n in lengths]
    ref = _draft_rounds(drafter, ref_cache, None, kept, rows, counts)
    graph = drafter.graph(8)
    if emulated:  # the emulator evaluates its inputs: the graph's function runs untraced
        mx.disable_compile()
    try:
        got = _draft_rounds(drafter, got_cache, graph, kept, rows, counts)
    finally:
        mx.enable_compile()
    for a, b in zip(ref, got, strict=True):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
    ends = [4 + sum(kept)] if rows == 1 else [4 + sum(n[r] for n in lengths) for r in range(rows)]
    for rc, gc in zip(ref_cache, got_cache, strict=True):
        got_ends = [gc.offset] if rows == 1 else gc.offset.tolist()
        assert got_ends == ends
        for r, n in enumerate(ends):
            for x, y in ((rc.keys, gc.keys), (rc.values, gc.values)):
                a, b = x[r, :, :n].astype(mx.float32), y[r, :, :n].astype(mx.float32)
                assert mx.array_equal(a, b), float(mx.abs(a - b).max())


def test_draft_graph_with_norm_and_rope_in_one_launch_drafts_alike(emulated_norm_rope, monkeypatch):
    """``HF2Q_NORM_ROPE=1``: the drafter's graph takes its queries and keys from the launch
    (every layer) and drafts what the layer path drafts, to MLX's roundings on this CPU (the
    launch has MLX's CUDA bits; the GPU test asks those)."""
    from hf2q.runtime.drafter import DFlashDraftModel

    monkeypatch.setattr(DFlashDraftModel, "fast_enabled", staticmethod(lambda: True))
    monkeypatch.setattr(select, "row_attention_enabled", lambda: True)
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "1")
    drafter = _drafter()
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size

    def cache():
        made = drafter.make_cache()
        feats = (mx.random.normal((1, 4, F), key=mx.random.key(2)) * 0.5).astype(mx.bfloat16)
        drafter.add_context(feats, made)
        return made

    ref = _draft_rounds(drafter, cache(), None, [5, 8, 1, 11])
    got = _draft_rounds(drafter, cache(), drafter.graph(8), [5, 8, 1, 11])
    assert len(emulated_norm_rope) >= 2 * len(drafter.layers)  # q and k of every layer
    for a, b in zip(ref, got, strict=True):
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=5e-2, atol=5e-2)


def test_draft_graph_with_the_layers_norms_in_the_launches_drafts_the_same_bits(
    emulated_norm_rope, emulated_products, monkeypatch
):
    """``HF2Q_NORM_MM=1`` under ``HF2Q_NORM_ROPE=1``, the products on the (emulated) kernels:
    every layer's k/v launch takes its context rows and its block rows normed in the launch
    (the joined launch), its q and MLP launches norm theirs, and the draft logits equal those
    without the switch bit for bit (MLX's norm computed in its CUDA order: the numpy model)."""
    from test_kernels_norm_mm import products_in_cuda_order

    from hf2q.runtime.drafter import DFlashDraftModel

    monkeypatch.setattr(DFlashDraftModel, "fast_enabled", staticmethod(lambda: True))
    monkeypatch.setattr(select, "row_attention_enabled", lambda: True)
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "1")
    kinds = products_in_cuda_order(monkeypatch)
    drafter = _drafter()
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(select.NORM_MM_ENV, flag)
        made = drafter.make_cache()
        feats = (mx.random.normal((1, 4, F), key=mx.random.key(2)) * 0.5).astype(mx.bfloat16)
        drafter.add_context(feats, made)
        outs.append(_draft_rounds(drafter, made, drafter.graph(8), [5, 8, 1, 11]))
    n = len(drafter.layers)
    assert kinds.count("joined2") == 4 * n and len(kinds) == 3 * 4 * n  # (q, MLP: single, grouped)
    for a, b in zip(*outs, strict=True):
        assert mx.array_equal(a, b)


@cuda_only
@pytest.mark.parametrize(
    "fixed,env", [("", "NORM_ROPE_ENV"), ("", "NORM_MM_ENV"), ("NORM_ROPE_ENV", "NORM_MM_ENV")]
)
def test_cuda_draft_graph_drafts_the_same_bits_with_the_launch_and_without(monkeypatch, fixed, env):
    # HF2Q_NORM_ROPE (q/k norm + RoPE in one launch each) and HF2Q_NORM_MM (the MLP's norm in
    # its gate/up launch; with NORM_ROPE, each layer's k/v launch joining its context and normed
    # block rows): the same draft logits bit for bit.
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "1")
    if fixed:
        monkeypatch.setenv(getattr(select, fixed), "1")
    drafter = _drafter()
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    outs = []
    monkeypatch.setenv(getattr(select, env), "1")
    assert env != "NORM_MM_ENV" or select.norm_mm_enabled()  # (this MLX's order: not vacuous)
    for flag in ("0", "1"):
        monkeypatch.setenv(getattr(select, env), flag)
        made = drafter.make_cache()
        feats = (mx.random.normal((1, 4, F), key=mx.random.key(2)) * 0.5).astype(mx.bfloat16)
        drafter.add_context(feats, made)
        outs.append(_draft_rounds(drafter, made, drafter.graph(8), [5, 8, 1, 11]))
    for a, b in zip(*outs, strict=True):
        assert mx.array_equal(a, b)
