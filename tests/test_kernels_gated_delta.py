"""The Gated-DeltaNet recurrence: the ops reference, and the CUDA kernels against it.

Three layers of checks:

* the ops reference (``gated_delta_steps_ops``) against a float64 NumPy re-statement of the rule,
  against mlx-lm's own ``gated_delta_update`` / ``gated_delta_ops``, and for the properties
  rollback relies on (per-step states equal running the steps one by one, replay equals the
  recorded state) - everywhere;
* the CUDA kernel sources run on the CPU through ``tests/cuda_emu.py`` (needs a C++ compiler),
  which checks their indexing, chunking and synchronisation without a GPU;
* the same kernels on a real GPU (``@pytest.mark.cuda``, skipped unless MLX's CUDA backend is up),
  including the Qwen3.5-4B shapes.

Tolerances: float32 relative error (||out - ref|| / ||ref||) at most 1e-5. bf16: the plain
recurrence kernel reads the same bf16 inputs as the ops and keeps float32 state, so it matches to
1e-5 as well; the fused kernel re-derives conv/SiLU/normalisation/gates, whose bf16 roundings
differ slightly from MLX's ops (its sigmoid and exp), so it is held to 5e-2 (measured about 1e-2).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, gated_delta_update

from hf2q.kernels import cuda_gated_delta as cg
from hf2q.kernels import select
from hf2q.kernels.gdn import gated_delta_steps_ops

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
F32_TOL = 1e-5
FUSED_BF16_TOL = 5e-2


def rel(a: mx.array, b: mx.array) -> float:
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    assert not mx.isnan(a32).any().item(), "output has NaN (an element was never written)"
    return (mx.linalg.norm(a32 - b32) / mx.linalg.norm(b32)).item()


def inputs(B=2, T=7, Hk=2, Hv=4, Dk=32, Dv=16, dtype=mx.float32, seed=0):
    """Random recurrence inputs with realistic scales (normalised keys, decays in (0.5, 1))."""
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype), state


def numpy_rule(q, k, v, g, beta, state):
    """The gated delta rule in float64 NumPy, written out step by step (the specification)."""
    q, k, v, g, beta, S = (
        np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v, g, beta, state)
    )
    B, T, Hk, _ = q.shape
    Hv = v.shape[2]
    rep = Hv // Hk
    ys = np.zeros(v.shape)
    states = np.zeros((B, T) + S.shape[1:])
    for b in range(B):
        for t in range(T):
            for h in range(Hv):
                kk, qq = k[b, t, h // rep], q[b, t, h // rep]
                S[b, h] *= g[b, t, h]  # decay
                delta = (v[b, t, h] - S[b, h] @ kk) * beta[b, t, h]
                S[b, h] += np.outer(delta, kk)  # delta-rule update
                ys[b, t, h] = S[b, h] @ qq
            states[b, t] = S[b]
    return ys, states


# -- the ops reference ---------------------------------------------------------------------------


def test_ops_reference_follows_the_written_out_rule_including_gqa():
    q, k, v, g, beta, s0 = inputs(B=2, T=6, Hk=2, Hv=4)
    y, states = gated_delta_steps_ops(q, k, v, g, beta, s0)
    y_np, states_np = numpy_rule(q, k, v, g, beta, s0)
    assert rel(y, mx.array(y_np)) <= F32_TOL
    assert rel(states, mx.array(states_np)) <= F32_TOL


def test_ops_reference_equals_mlx_lm_gated_delta_update():
    q, k, v, _, _, s0 = inputs(B=1, T=9, Hk=2, Hv=4, seed=1)
    Hv = v.shape[2]
    a = mx.random.normal((1, 9, Hv))
    b = mx.random.normal((1, 9, Hv))
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (Hv,)))
    dt_bias = mx.ones((Hv,))
    y_ref, final_ref = gated_delta_update(q, k, v, a, b, A_log, dt_bias, s0, None)
    y, states = gated_delta_steps_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), s0)
    assert rel(y, y_ref) <= F32_TOL
    assert rel(states[:, -1], final_ref) <= F32_TOL


def test_mx_fast_gated_delta_update_takes_the_state_as_b_hv_dv_dk():
    # Its docstring names the state shape [B, T, Hk, Dv]; in fact it is (B, Hv, Dv, Dk) like
    # mlx-lm's, and it returns the final state only (no per-step states for rollback).
    q, k, v, g, beta, s0 = inputs(B=1, T=5, Hk=2, Hv=4, seed=2)
    y, final = mx.fast.gated_delta_update(q, k, v, g, beta, s0)
    y_ref, states = gated_delta_steps_ops(q, k, v, g, beta, s0)
    assert final.shape == s0.shape
    assert rel(y, y_ref) <= F32_TOL
    assert rel(final, states[:, -1]) <= F32_TOL


def test_per_step_states_equal_running_the_steps_one_by_one():
    q, k, v, g, beta, s0 = inputs(B=2, T=6, seed=3)
    _, states = gated_delta_steps_ops(q, k, v, g, beta, s0)
    for t in range(6):
        _, s_t = gated_delta_ops(
            q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], s0
        )
        assert rel(states[:, t], s_t) <= F32_TOL


def test_grouped_heads_equal_explicitly_repeated_keys():
    q, k, v, g, beta, s0 = inputs(B=1, T=5, Hk=2, Hv=6, seed=4)
    y, states = gated_delta_steps_ops(q, k, v, g, beta, s0)
    y_rep, states_rep = gated_delta_steps_ops(
        mx.repeat(q, 3, axis=2), mx.repeat(k, 3, axis=2), v, g, beta, s0
    )
    assert mx.array_equal(y, y_rep)
    assert mx.array_equal(states, states_rep)


def test_replaying_n_steps_gives_the_recorded_state():
    q, k, v, g, beta, s0 = inputs(B=2, T=8, seed=5)
    _, states = gated_delta_steps_ops(q, k, v, g, beta, s0)
    for n in (1, 3, 8):
        replayed = gated_delta_steps_ops(q, k, v, g, beta, s0, record="final", steps=n)
        assert mx.array_equal(replayed, states[:, n - 1])


def test_final_record_returns_the_last_state_and_the_same_outputs():
    q, k, v, g, beta, s0 = inputs(B=1, T=4, seed=6)
    y, states = gated_delta_steps_ops(q, k, v, g, beta, s0)
    y2, final = gated_delta_steps_ops(q, k, v, g, beta, s0, record="final")
    assert mx.array_equal(y, y2)
    assert mx.array_equal(final, states[:, -1])


def test_kernels_refuse_shapes_they_do_not_support():
    with pytest.raises(cg.UnsupportedShape, match="multiple of 16"):
        cg.check_shapes(Dk=24, Dv=16, Hk=1, Hv=1, T=4)
    with pytest.raises(cg.UnsupportedShape, match="multiple of 8"):
        cg.check_shapes(Dk=32, Dv=12, Hk=1, Hv=1, T=4)
    with pytest.raises(cg.UnsupportedShape, match="not a multiple"):
        cg.check_shapes(Dk=32, Dv=16, Hk=3, Hv=4, T=4)
    assert cg.warps_for(128) == 4 and cg.warps_for(16) == 2 and cg.warps_for(8) == 1


# -- the CUDA kernels: emulated on the CPU, and on a real GPU ---------------------------------------


@cache
def _emulated_kernel(**variant):
    """One emulated kernel per variant for the whole session (each build is compiled once)."""
    import cuda_emu

    return cuda_emu.EmulatedKernel(**cg.kernel_spec(**variant))


def _cpp_available() -> bool:
    import cuda_emu

    return cuda_emu.compiler() is not None


@pytest.fixture(
    params=[
        pytest.param("emulated", marks=pytest.mark.slow),
        pytest.param("cuda", marks=pytest.mark.cuda),
    ]
)
def kernels(request, monkeypatch):
    """Run the CUDA kernel wrappers on the CPU emulator or on the GPU."""
    if request.param == "cuda":
        if not HAS_CUDA:
            pytest.skip("MLX's CUDA backend is not available")
        with mx.stream(mx.gpu):
            yield "cuda"
        return
    if not _cpp_available():
        pytest.skip("no C++ compiler for the CUDA emulator")
    monkeypatch.setattr(cg, "_kernel", _emulated_kernel)
    with mx.stream(mx.cpu):
        yield "emulated"


SHAPES = [
    # B, T, Hk, Hv, Dk, Dv: GQA + two shared-memory chunks; one step (decode); real head dims
    (2, 20, 2, 4, 32, 16),
    (1, 1, 1, 2, 16, 8),
    (1, 16, 1, 1, 128, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}Hk{}Hv{}Dk{}Dv{}".format(*s))
def test_steps_kernel_matches_the_ops_reference_in_float32(kernels, shape):
    B, T, Hk, Hv, Dk, Dv = shape
    q, k, v, g, beta, s0 = inputs(B, T, Hk, Hv, Dk, Dv, seed=10)
    y_ref, states_ref = gated_delta_steps_ops(q, k, v, g, beta, s0)
    y, states = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="states")
    assert y.dtype == q.dtype and states.shape == (B, T, Hv, Dv, Dk)
    assert rel(y, y_ref) <= F32_TOL
    assert rel(states, states_ref) <= F32_TOL
    y2, final = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="final")
    assert rel(y2, y_ref) <= F32_TOL
    assert rel(final, states_ref[:, -1]) <= F32_TOL
    for n in sorted({1, (T + 1) // 2, T}):
        replayed = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="final", steps=n)
        assert rel(replayed, states_ref[:, n - 1]) <= F32_TOL


def test_replay_with_a_count_per_row_gives_each_rows_recorded_state(kernels):
    # A ragged rollback of batched slots: each batch row replays its own number of steps, and its
    # state is the one the same kernel recorded after that step, bit for bit.
    B, T, Hk, Hv, Dk, Dv = 3, 20, 2, 4, 32, 16
    q, k, v, g, beta, s0 = inputs(B, T, Hk, Hv, Dk, Dv, seed=14)
    _, states = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="states")
    keep = [1, 17, 9]
    got = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="final", steps=mx.array(keep))
    for row, n in enumerate(keep):
        assert mx.array_equal(got[row], states[row, n - 1]), f"row {row}, {n} steps"
    with pytest.raises(ValueError, match="one count or one per batch row"):
        cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="final", steps=mx.array([1, 2]))


def test_steps_kernel_in_bfloat16_keeps_float32_state(kernels):
    q, k, v, g, beta, s0 = inputs(2, 9, 2, 4, 32, 16, dtype=mx.bfloat16, seed=11)
    y_ref, states_ref = gated_delta_steps_ops(q, k, v, g, beta, s0)
    y, states = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0)
    assert y.dtype == mx.bfloat16 and states.dtype == mx.float32
    assert rel(states, states_ref) <= F32_TOL
    assert rel(y, y_ref) <= 1e-2  # y itself is rounded to bf16


def _tiny_gdn(dtype, *, Hk=2, Hv=4, Dk=32, Dv=16, seed=0):
    from mlx_lm.models import qwen3_5

    args = qwen3_5.TextModelArgs(
        model_type="qwen3_5_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=Hk,
        linear_num_value_heads=Hv,
        linear_key_head_dim=Dk,
        linear_value_head_dim=Dv,
        vocab_size=64,
    )
    mx.random.seed(seed)
    attn = qwen3_5.GatedDeltaNet(args)
    if dtype != mx.float32:
        attn.set_dtype(dtype)
        attn.A_log = attn.A_log.astype(mx.float32)  # as mlx-lm's cast_predicate keeps it
    return attn


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_fused_kernel_matches_mlx_lm_ops_for_a_whole_block(kernels, dtype):
    from hf2q.kernels.gdn import gdn_mixer, rollback_state

    attn = _tiny_gdn(dtype)
    B, T = 2, 18
    mx.random.seed(12)
    x = mx.random.normal((B, T, 64)).astype(dtype)
    conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(dtype)
    state = mx.random.normal((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.1
    tol = F32_TOL if dtype == mx.float32 else FUSED_BF16_TOL
    out_ref, rec_ref = gdn_mixer(attn, x, conv_state, state, impl="ops", record="states")
    for record in ("states", "final"):
        out, rec = gdn_mixer(attn, x, conv_state, state, impl="cuda", record=record)
        assert rel(out, out_ref) <= tol
        assert rel(rec.final_state, rec_ref.final_state) <= tol
        for n in (1, 7, T):
            assert rel(rollback_state(attn, rec, n, impl="cuda"), rec_ref.rec[:, n - 1]) <= tol


@pytest.mark.parametrize(
    "heads, blocks",
    [
        # (5 steps: one pass of each block's share; 20: three passes, two chunks, a ragged end)
        ((2, 4, 32, 16), ((5, "states"), (20, "final"))),
        ((1, 1, 16, 64), ((5, "final"),)),
        ((2, 2, 32, 32), ((5, "final"),)),
    ],
    ids=["gqa", "tiles", "mha"],
)
def test_fused_kernel_writes_the_conv_window_the_record_keeps(kernels, heads, blocks):
    # The window variant's extra output is concatenate([conv_state, qkv], axis=1) bit for bit
    # (each batch row's blocks copy a share of it, with grouped heads and several row tiles),
    # and the rest of the launch is unchanged.
    Hk, Hv, Dk, Dv = heads
    attn = _tiny_gdn(mx.bfloat16, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, seed=5)
    dims = dict(num_k_heads=Hk, key_dim=Dk, num_v_heads=Hv, value_dim=Dv)
    mx.random.seed(17)
    B = 3
    for T, record in blocks:
        qkv = (mx.random.normal((B, T, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
        conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
        a, b = (mx.random.normal((B, T, Hv)).astype(mx.bfloat16) for _ in range(2))
        state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
        args = (conv_state, qkv, attn.conv1d.weight, a, b, attn.A_log, attn.dt_bias, state)
        want = mx.concatenate([conv_state, qkv], axis=1)
        y0, rec0 = cg.gdn_fused_cuda(*args, **dims, record=record)
        y, rec, window = cg.gdn_fused_cuda(*args, **dims, record=record, window=True)
        assert window.dtype == mx.bfloat16 and mx.array_equal(window, want), (T, record)
        assert mx.array_equal(y, y0) and mx.array_equal(rec, rec0), (T, record)
    with pytest.raises(ValueError, match="window"):
        cg.gdn_fused_cuda(*args, **dims, record="final", steps=2, window=True)


def test_the_mixer_takes_its_record_from_the_kernels_window_unless_switched_off(
    kernels, monkeypatch
):
    from hf2q.errors import UsageError
    from hf2q.kernels import select
    from hf2q.kernels.gdn import gdn_mixer

    attn = _tiny_gdn(mx.bfloat16, seed=6)
    mx.random.seed(18)
    x = mx.random.normal((2, 4, 64)).astype(mx.bfloat16)
    conv_state = (mx.random.normal((2, 3, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
    state = mx.random.normal((2, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.1
    runs = {}
    for value in ("1", "0"):
        monkeypatch.setenv(select.GDN_WINDOW_ENV, value)
        runs[value] = gdn_mixer(attn, x, conv_state, state, impl="cuda", record="final")
    (out1, rec1), (out0, rec0) = runs["1"], runs["0"]
    assert mx.array_equal(out1, out0) and mx.array_equal(rec1.rec, rec0.rec)
    assert mx.array_equal(rec1.conv_input, rec0.conv_input)
    assert mx.array_equal(rec1.conv_input[:, :3], conv_state)
    monkeypatch.setenv(select.GDN_WINDOW_ENV, "sometimes")
    with pytest.raises(UsageError, match="HF2Q_GDN_WINDOW"):
        select.gdn_window_enabled()


def test_fused_replay_with_a_count_per_row_gives_each_rows_recorded_state(kernels):
    attn = _tiny_gdn(mx.bfloat16, seed=3)
    B, T = 3, 16
    mx.random.seed(15)
    qkv = (mx.random.normal((B, T, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
    conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
    a, b = (mx.random.normal((B, T, attn.num_v_heads)).astype(mx.bfloat16) for _ in range(2))
    state = mx.random.normal((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.1
    dims = dict(
        num_k_heads=attn.num_k_heads,
        key_dim=attn.head_k_dim,
        num_v_heads=attn.num_v_heads,
        value_dim=attn.head_v_dim,
    )
    args = (conv_state, qkv, attn.conv1d.weight, a, b, attn.A_log, attn.dt_bias, state)
    _, states = cg.gdn_fused_cuda(*args, **dims, record="states")
    keep = [16, 2, 11]
    got = cg.gdn_fused_cuda(*args, **dims, record="final", steps=mx.array(keep))
    for row, n in enumerate(keep):
        assert mx.array_equal(got[row], states[row, n - 1]), f"row {row}, {n} steps"
    # The joined read (a verify record's whole conv window, what the rollback's replay passes):
    # the same bits from one input.
    window = mx.concatenate([conv_state, qkv], axis=1)
    joined = cg.gdn_fused_cuda(
        None, window, *args[2:], **dims, record="final", steps=mx.array(keep)
    )
    assert mx.array_equal(joined, got)
    with pytest.raises(cg.UnsupportedShape, match="conv window"):
        cg.gdn_fused_cuda(None, qkv, *args[2:], **dims, record="final", steps=mx.array(keep))


@pytest.mark.parametrize(
    "heads, T",
    [
        ((2, 4, 32, 16), 1),  # a decode step
        ((2, 4, 32, 16), 16),  # a verify block: one full chunk
        ((2, 4, 32, 16), 20),  # two chunks, the second ragged
        ((1, 2, 16, 64), 5),  # more channels than threads: several per thread
    ],
    ids=["decode", "verify", "chunks", "tiles"],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_fused_kernel_reads_each_channels_rows_once_with_the_same_bits(kernels, heads, T, dtype):
    # The conv read a thread per channel (every row of the chunk loaded before any is used) gives
    # the bits of the read a thread per (step, channel) it replaced: outputs, per-step states,
    # the window, replays per row and the joined read of a verify's record.
    Hk, Hv, Dk, Dv = heads
    attn = _tiny_gdn(dtype, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, seed=6)
    dims = dict(num_k_heads=Hk, key_dim=Dk, num_v_heads=Hv, value_dim=Dv)
    mx.random.seed(18)
    B = 2
    qkv = (mx.random.normal((B, T, attn.conv_dim)) * 0.5).astype(dtype)
    conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(dtype)
    a, b = (mx.random.normal((B, T, Hv)).astype(dtype) for _ in range(2))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    args = (conv_state, qkv, attn.conv1d.weight, a, b, attn.A_log, attn.dt_bias, state)
    for kw in (dict(record="states", window=True), dict(record="final")):
        new = cg.gdn_fused_cuda(*args, **dims, **kw)
        old = cg.gdn_fused_cuda(*args, **dims, **kw, step_loads=True)
        assert len(new) == len(old)
        for got, want in zip(new, old, strict=True):
            assert mx.array_equal(got, want), kw
    keep = mx.array([T, (T + 1) // 2], dtype=mx.int32)
    window = mx.concatenate([conv_state, qkv], axis=1)
    for first in (conv_state, None):
        src = qkv if first is not None else window
        got = cg.gdn_fused_cuda(first, src, *args[2:], **dims, record="final", steps=keep)
        want = cg.gdn_fused_cuda(
            first, src, *args[2:], **dims, record="final", steps=keep, step_loads=True
        )
        assert mx.array_equal(got, want)
    with pytest.raises(ValueError, match="step_loads"):
        cg.Variant(fused=False, record="final", write_y=True, replay=False, step_loads=True)


def test_fused_kernel_reads_a_state_that_starts_off_its_16_byte_alignment(kernels):
    # The state is read 16 bytes a load where its base allows; a row-contiguous view 4 bytes into
    # a buffer (what a slice can hand the kernel without a copy) takes the scalar read, same bits.
    attn = _tiny_gdn(mx.bfloat16, seed=7)
    Hk, Hv, Dk, Dv = attn.num_k_heads, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim
    dims = dict(num_k_heads=Hk, key_dim=Dk, num_v_heads=Hv, value_dim=Dv)
    mx.random.seed(19)
    B, T = 2, 5
    qkv = (mx.random.normal((B, T, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
    conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
    a, b = (mx.random.normal((B, T, Hv)).astype(mx.bfloat16) for _ in range(2))
    flat = mx.random.normal((B * Hv * Dv * Dk + 1,)) * 0.1
    mx.eval(flat)
    shifted = flat[1:].reshape(B, Hv, Dv, Dk)
    aligned = mx.array(shifted)  # a copy of its own
    rest = (attn.conv1d.weight, a, b, attn.A_log, attn.dt_bias)
    for kw in (dict(record="states"), dict(record="final", window=True)):
        got = cg.gdn_fused_cuda(conv_state, qkv, *rest, shifted, **dims, **kw)
        want = cg.gdn_fused_cuda(conv_state, qkv, *rest, aligned, **dims, **kw)
        for g, w in zip(got, want, strict=True):
            assert mx.array_equal(g, w), kw


def test_final_state_record_replays_each_rows_kept_steps(kernels, monkeypatch):
    # HF2Q_GDN_RECORD=final's rollback (hf2q.kernels.gdn.replay_rows): each row's state after its
    # own kept count equals the per-step record's, bit for bit.
    import functools

    from hf2q.kernels import gdn
    from hf2q.kernels.gdn import gdn_mixer, replay_rows

    if kernels == "emulated":  # the emulator runs eagerly: the replay uncompiled
        monkeypatch.setattr(gdn, "_replay_fn", lambda *d: functools.partial(gdn._replay_call, *d))
    attn = _tiny_gdn(mx.bfloat16, seed=4)
    B, T = 3, 16
    mx.random.seed(16)
    x = mx.random.normal((B, T, 64)).astype(mx.bfloat16)
    conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
    state = mx.random.normal((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.1
    _, per_step = gdn_mixer(attn, x, conv_state, state, impl="cuda", record="states")
    _, final = gdn_mixer(attn, x, conv_state, state, impl="cuda", record="final")
    keep = mx.array([5, 16, 1], dtype=mx.int32)
    want = replay_rows(attn, per_step, keep, impl="cuda")
    assert mx.array_equal(replay_rows(attn, final, keep, impl="cuda"), want)
    for row, n in enumerate(keep.tolist()):
        assert mx.array_equal(want[row], per_step.rec[row, n - 1])


@cache
def _emulated_layers_kernel(layers):
    import cuda_emu

    return cuda_emu.EmulatedKernel(**cg.replay_layers_spec(layers))


def _final_records(kernels, monkeypatch, layers, B, T, seed):
    """``layers`` distinct tiny Gated-DeltaNet layers, each with a final-state and a per-step
    record of its own random block (the emulator runs the replays uncompiled)."""
    import functools

    from hf2q.kernels import gdn

    if kernels == "emulated":
        monkeypatch.setattr(gdn, "_replay_fn", lambda *d: functools.partial(gdn._replay_call, *d))
        monkeypatch.setattr(cg, "_layers_kernel", _emulated_layers_kernel)
    out = []
    for i in range(layers):
        attn = _tiny_gdn(mx.bfloat16, seed=seed + i)
        mx.random.seed(seed + 100 + i)
        x = mx.random.normal((B, T, 64)).astype(mx.bfloat16)
        conv_state = (mx.random.normal((B, 3, attn.conv_dim)) * 0.5).astype(mx.bfloat16)
        state = mx.random.normal((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.1
        _, per_step = gdn.gdn_mixer(attn, x, conv_state, state, impl="cuda", record="states")
        _, final = gdn.gdn_mixer(attn, x, conv_state, state, impl="cuda", record="final")
        out.append((attn, final, per_step))
    return out


def test_one_launch_replays_every_layer_as_its_own_replay(kernels, monkeypatch):
    # The joined rollback of final-state records (hf2q.kernels.gdn.replay_layers, one launch for
    # all layers): each layer's state after each row's own kept count has the bits of that
    # layer's own replay and of its per-step record, for layers that differ in weights and
    # inputs (a wrong pick of a layer's pointers would mix them up).
    from hf2q.kernels import gdn

    monkeypatch.setattr(select, "replay_layers_enabled", lambda: True)
    B, T = 3, 16
    recs = _final_records(kernels, monkeypatch, 3, B, T, seed=30)
    replays = [gdn.RowReplay(attn, final, "cuda") for attn, final, _ in recs]
    for keep in ([5, 16, 1], [16, 16, 16], [2, 9, 14]):
        keep = mx.array(keep, dtype=mx.int32)
        joined = gdn.replay_layers(replays, keep)
        assert joined is not None and len(joined) == 3
        for (_, _, per_step), got, own in zip(recs, joined, replays, strict=True):
            assert mx.array_equal(got, own(keep))
            for row, n in enumerate(keep.tolist()):
                assert mx.array_equal(got[row], per_step.rec[row, n - 1])
    # Distinct layers really were replayed from their own inputs.
    assert not mx.array_equal(joined[0], joined[1])


def test_one_launch_replay_applies_only_to_cuda_final_records(kernels, monkeypatch):
    from hf2q.kernels import gdn

    recs = _final_records(kernels, monkeypatch, 2, 2, 4, seed=40)
    keep = mx.array([1, 3], dtype=mx.int32)
    replays = [gdn.RowReplay(attn, final, "cuda") for attn, final, _ in recs]
    monkeypatch.setattr(select, "replay_layers_enabled", lambda: False)
    assert gdn.replay_layers(replays, keep) is None  # HF2Q_REPLAY_LAYERS=0, or off CUDA
    monkeypatch.setattr(select, "replay_layers_enabled", lambda: True)
    assert gdn.replay_layers(replays, keep) is not None
    per_step = [gdn.RowReplay(attn, rec, "cuda") for attn, _, rec in recs]
    assert gdn.replay_layers(per_step, keep) is None
    ops = [gdn.RowReplay(attn, final, "ops") for attn, final, _ in recs]
    assert gdn.replay_layers(ops, keep) is None
    other = _tiny_gdn(mx.bfloat16, Hk=1, Hv=2, Dk=32, Dv=16, seed=41)
    assert gdn.replay_layers([replays[0], gdn.RowReplay(other, recs[1][1], "cuda")], keep) is None


def test_recurrence_kernel_after_mlx_lm_ops_matches_the_ops_mixer(kernels):
    from hf2q.kernels.gdn import gdn_mixer, rollback_state

    attn = _tiny_gdn(mx.float32, seed=1)
    mx.random.seed(13)
    x = mx.random.normal((1, 5, 64))
    out_ref, rec_ref = gdn_mixer(attn, x, None, None, impl="ops", record="states")
    out, rec = gdn_mixer(attn, x, None, None, impl="cuda_steps", record="final")
    assert rel(out, out_ref) <= F32_TOL
    assert rel(rollback_state(attn, rec, 2, impl="cuda_steps"), rec_ref.rec[:, 1]) <= F32_TOL


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")
@pytest.mark.parametrize("T", [1, 16])
def test_kernels_on_the_qwen35_4b_shapes(T):
    # Qwen3.5-4B: 16 key heads, 32 value heads, head dims 128 (Hv > Hk: grouped heads).
    q, k, v, g, beta, s0 = inputs(1, T, 16, 32, 128, 128, dtype=mx.bfloat16, seed=20)
    y_ref, states_ref = gated_delta_steps_ops(q, k, v, g, beta, s0)
    y, states = cg.gated_delta_steps_cuda(q, k, v, g, beta, s0, record="states")
    assert rel(states, states_ref) <= F32_TOL
    assert rel(y, y_ref) <= 1e-2
    attn = _tiny_gdn(mx.float32, Hk=16, Hv=32, Dk=128, Dv=128, seed=2)
    from hf2q.kernels.gdn import gdn_mixer

    x = mx.random.normal((1, T, 64))
    out_ref, rec_ref = gdn_mixer(attn, x, None, None, impl="ops", record="states")
    out, rec = gdn_mixer(attn, x, None, None, impl="cuda", record="states")
    assert rel(out, out_ref) <= F32_TOL
    assert rel(rec.rec, rec_ref.rec) <= F32_TOL


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")
def test_compiled_layer_with_the_fused_kernel_equals_the_uncompiled_one():
    from mlx_lm.models import qwen3_5

    from hf2q.kernels.gdn import compile_gdn_decoder_layer, empty_states, gdn_decoder_layer

    args = qwen3_5.TextModelArgs(
        model_type="qwen3_5_text",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=32,
        vocab_size=64,
    )
    mx.random.seed(21)
    layer = qwen3_5.DecoderLayer(args, 0)
    conv_state, state = empty_states(layer.linear_attn, 1, mx.float32)
    for T in (1, 16):
        x = mx.random.normal((1, T, 128))
        out, rec = gdn_decoder_layer(layer, x, conv_state, state, impl="cuda", record="states")
        run = compile_gdn_decoder_layer(layer, impl="cuda", record="states")
        out_c, rec_c = run(x, conv_state, state)
        assert rel(out_c, out) <= F32_TOL
        assert rel(rec_c.rec, rec.rec) <= F32_TOL
