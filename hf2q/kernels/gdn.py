"""Gated-DeltaNet layers as pure functions over mlx-lm's own modules, with exact rollback records.

What it does: compute what ``mlx_lm.models.qwen3_5.GatedDeltaNet`` computes (same parameters,
same math) as a function of ``(x, conv_state, state)`` that returns the output and a
:class:`GdnRecord` instead of mutating a cache, so that

* a verify block of T tokens can be rolled back to any n <= T kept tokens exactly
  (:func:`rollback`): from per-step states (``record="states"``, a view) or by replaying n steps
  from the initial state (``record="final"``);
* a whole decoder layer (norms, mixer, MLP) can be wrapped in ``mx.compile``
  (:func:`compile_gdn_decoder_layer`), which removes the Python overhead and fuses the
  elementwise work of the step;
* the recurrence runs where it is fastest: ``impl="cuda"`` (one fused CUDA kernel for conv,
  SiLU, q/k normalisation, gates and recurrence), ``"cuda_steps"`` (mlx-lm ops up to the
  recurrence, then the CUDA recurrence kernel), ``"mlx"`` (mlx-lm's ``gated_delta_update``:
  its Metal kernel on Apple GPUs, ops elsewhere; final state only) or ``"ops"`` (portable ops).

What it does not do: own caches, decide acceptance, or support padding masks (batched prompts
with left padding keep mlx-lm's own layer call). Nothing upstream is patched.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from hf2q.kernels import cuda_norm, select
from hf2q.kernels.cuda_rollback import compiled_on_cuda
from hf2q.kernels.linear import kept_view, linear, linears, normed, swiglu_mlp

IMPLS = ("ops", "mlx", "cuda_steps", "cuda")
RECORDS = ("states", "final")


class GdnRecord(NamedTuple):
    """What exact rollback of one Gated-DeltaNet layer after a block of T tokens needs.

    Attributes:
        conv_input: (B, K-1+T, C) the conv rows before the block followed by the block's
            ``in_proj_qkv`` rows; the conv state after n kept tokens is ``conv_input[:, n:n+K-1]``.
        a, b: (B, T, Hv) gate projections of the block (replay needs them).
        state0: (B, Hv, Dv, Dk) float32 recurrent state before the block.
        rec: per-step states (B, T, Hv, Dv, Dk) when ``record == "states"``, else the final
            state (B, Hv, Dv, Dk).
        record: ``"states"`` or ``"final"``.
    """

    conv_input: mx.array
    a: mx.array
    b: mx.array
    state0: mx.array
    rec: mx.array
    record: str

    @property
    def steps(self) -> int:
        return int(self.a.shape[1])

    @property
    def kept_rows(self) -> int:
        """K-1: conv rows carried between blocks."""
        return int(self.conv_input.shape[1]) - self.steps

    @property
    def conv_state(self) -> mx.array:
        return self.conv_input[:, : self.kept_rows]

    @property
    def qkv(self) -> mx.array:
        return self.conv_input[:, self.kept_rows :]

    def conv_state_after(self, n: int) -> mx.array:
        """Conv state after keeping the first ``n`` tokens of the block: (B, K-1, C), a view."""
        return self.conv_input[:, n : n + self.kept_rows]

    @property
    def final_state(self) -> mx.array:
        return self.rec[:, -1] if self.record == "states" else self.rec

    @property
    def final_conv_state(self) -> mx.array:
        return self.conv_state_after(self.steps)


# -- the recurrence as ops ------------------------------------------------------------------------


def _step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array):
    # q, k: (B, Hv, Dk); v: (B, Hv, Dv); g, beta: (B, Hv); state: (B, Hv, Dv, Dk) float32.
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # (B, Hv, Dv)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


_step_compiled = mx.compile(_step)


def gated_delta_steps_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    record: str = "states",
    steps: int | None = None,
) -> tuple[mx.array, mx.array] | mx.array:
    """The gated delta rule over T steps with ops (runs on every MLX device).

    Same contract as :func:`hf2q.kernels.cuda_gated_delta.gated_delta_steps_cuda`: returns
    ``(y, states)`` (per-step states, ``record="states"``) or ``(y, final)``; with ``steps=n`` only
    the final state after n steps.
    """
    T, Hk = q.shape[1], q.shape[2]
    Hv = v.shape[2]
    if Hv > Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    n = T if steps is None else min(int(steps), T)
    ys: list[mx.array] = []
    states: list[mx.array] = []
    for t in range(n):
        y, state = _step_compiled(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        if record == "states" and steps is None:
            states.append(state)
    if steps is not None:
        return state
    y_all = mx.stack(ys, axis=1)
    if record == "states":
        return y_all, mx.stack(states, axis=1)
    return y_all, state


# -- concatenated projections ---------------------------------------------------------------------


def concat_linears(mods: list[nn.Module]) -> nn.Module:
    """One linear layer computing ``concatenate([m(x) for m in mods], -1)`` with one matmul.

    Works for ``nn.Linear`` (no bias) and ``nn.QuantizedLinear`` with equal quantization; the
    weights are copied (the originals stay untouched and usable).
    """
    first = mods[0]
    if any(type(m) is not type(first) for m in mods):
        raise ValueError("cannot concatenate linear layers of different types")
    if isinstance(first, nn.QuantizedLinear):
        out = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(out)
        for attr in ("group_size", "bits", "mode"):
            if hasattr(first, attr):
                vals = {getattr(m, attr) for m in mods}
                if len(vals) != 1:
                    raise ValueError(f"cannot concatenate linear layers with different {attr}")
                setattr(out, attr, getattr(first, attr))
        for name in list(first):
            if name == "bias":
                raise ValueError("concat_linears supports layers without bias")
            out[name] = mx.concatenate([m[name] for m in mods], axis=0)
        out.freeze()
        return out
    if isinstance(first, nn.Linear):
        if any("bias" in m for m in mods):
            raise ValueError("concat_linears supports layers without bias")
        out = nn.Linear(1, 1, bias=False)
        out.weight = mx.concatenate([m.weight for m in mods], axis=0)
        return out
    raise ValueError(f"cannot concatenate {type(first).__name__} layers")


class FusedProjections(NamedTuple):
    """A Gated-DeltaNet decoder layer's input projections as two matmuls instead of six.

    ``in_proj``: ``[in_proj_qkv; in_proj_z; in_proj_b; in_proj_a]``; ``gate_up``: the MLP's
    ``[gate_proj; up_proj]``. Built once per layer by :func:`fuse_projections`.
    """

    in_proj: nn.Module
    gate_up: nn.Module


def fuse_projections(layer: nn.Module) -> FusedProjections:
    """Concatenated projections of a linear-attention decoder layer (weights copied once)."""
    a = layer.linear_attn
    return FusedProjections(
        concat_linears([a.in_proj_qkv, a.in_proj_z, a.in_proj_b, a.in_proj_a]),
        concat_linears([layer.mlp.gate_proj, layer.mlp.up_proj]),
    )


def mlp_fused(
    mlp: nn.Module, gate_up: nn.Module, x: mx.array, mm: bool = False, add: mx.array | None = None
) -> mx.array:
    """mlx-lm's SwiGLU MLP with its gate and up projections done as one matmul (``mm``: products
    through :func:`hf2q.kernels.linear.linear`; ``add``: a residual added to the output)."""
    from mlx_lm.models.activations import swiglu

    g, u = mx.split(linear(gate_up, x, mm), 2, axis=-1)
    return linear(mlp.down_proj, swiglu(g, u), mm, add=add)


# -- one Gated-DeltaNet mixer ----------------------------------------------------------------------


def prepare_ops(attn: nn.Module, conv_input: mx.array, a: mx.array, b: mx.array):
    """mlx-lm's conv + SiLU, split, q/k normalisation and gates for the T rows of ``a``/``b``.

    ``conv_input``: (B, K-1+T, C) the conv state followed by the block's ``in_proj_qkv`` rows.
    """
    B, T, _ = a.shape
    conv_out = nn.silu(attn.conv1d(conv_input))
    q, k, v = (
        t.reshape(B, T, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    )
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)
    return q, k, v, compute_g(attn.A_log, a, attn.dt_bias), mx.sigmoid(b)


def _recurrence(
    attn: nn.Module,
    conv_state: mx.array,
    qkv: mx.array,
    conv_input: mx.array,
    a: mx.array,
    b: mx.array,
    state: mx.array,
    *,
    impl: str,
    record: str,
    steps: int | None = None,
):
    if impl == "cuda":
        return _fused_call(
            *_heads(attn),
            conv_state,
            qkv,
            a,
            b,
            state,
            steps,
            conv_weight(attn),
            attn.A_log,
            attn.dt_bias,
            record="final" if steps is not None else record,
        )
    if steps is not None and impl != "cuda_steps":
        # Replay with ops: only the first `steps` rows are needed.
        K1 = conv_input.shape[1] - a.shape[1]
        conv_input, a, b = conv_input[:, : K1 + steps], a[:, :steps], b[:, :steps]
    q, k, v, g, beta = prepare_ops(attn, conv_input, a, b)
    if impl == "cuda_steps":
        from hf2q.kernels.cuda_gated_delta import gated_delta_steps_cuda

        return gated_delta_steps_cuda(
            q, k, v, g, beta, state, record="final" if steps is not None else record, steps=steps
        )
    if impl == "mlx":
        if record != "final" and steps is None:
            raise ValueError("impl 'mlx' records the final state only: use record='final'")
        # gated_delta_update takes raw a/b; recompute from them exactly as mlx-lm does.
        y, final = gated_delta_update(q, k, v, a, b, attn.A_log, attn.dt_bias, state, None)
        return final if steps is not None else (y, final)
    if impl == "ops":
        return gated_delta_steps_ops(
            q, k, v, g, beta, state, record="final" if steps is not None else record, steps=steps
        )
    raise ValueError(f"unknown impl {impl!r} (choose from {', '.join(IMPLS)})")


def gdn_mixer(
    attn: nn.Module,
    x: mx.array,
    conv_state: mx.array | None,
    state: mx.array | None,
    *,
    impl: str = "ops",
    record: str = "states",
    in_proj: nn.Module | None = None,
    mm: bool = False,
    residual: mx.array | None = None,
) -> tuple[mx.array, GdnRecord]:
    """One ``GatedDeltaNet`` (``layer.linear_attn``) over ``x`` (B, T, H), without a cache.

    Args:
        attn: mlx-lm's ``GatedDeltaNet`` module (its parameters are used as they are).
        x: (B, T, hidden) the normed layer input.
        conv_state: (B, K-1, C) or None (zeros, a fresh sequence).
        state: (B, Hv, Dv, Dk) float32 or None (zeros).
        impl: one of :data:`IMPLS`.
        record: ``"states"`` (per-step states) or ``"final"``.
        in_proj: ``FusedProjections.in_proj`` of this layer: one matmul for qkv, z, b and a.
        mm: products through :func:`hf2q.kernels.linear.linear` (the small-M kernel on CUDA).
        residual: added to the output (the decoder layer's residual connection; with the
            kernel, in the output projection's launch).

    Returns:
        ``(out, record)``: out (B, T, hidden) as mlx-lm's layer returns it (plus ``residual``),
        and the record.
    """
    if record not in RECORDS:
        raise ValueError(f"record must be one of {RECORDS}, not {record!r}")
    B, T, _ = x.shape
    if in_proj is None:
        qkv, z, b, a = linears(
            [attn.in_proj_qkv, attn.in_proj_z, attn.in_proj_b, attn.in_proj_a], x, mm
        )
    else:
        C, V, H = attn.conv_dim, attn.value_dim, attn.num_v_heads
        qkv, z, b, a = mx.split(linear(in_proj, x, mm), [C, C + V, C + V + H], axis=-1)
    z = z.reshape(B, T, attn.num_v_heads, attn.head_v_dim)
    if conv_state is None:
        conv_state = mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), dtype=x.dtype)
    if state is None:
        state = mx.zeros((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32)
    if impl == "cuda":
        y, rec, conv_input = fused_block(attn, conv_state, qkv, a, b, state, record=record)
    else:
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        y, rec = _recurrence(
            attn, conv_state, qkv, conv_input, a, b, state, impl=impl, record=record
        )
    out = linear(
        attn.out_proj, gated_norm(attn.norm, y, z, impl).reshape(B, T, -1), mm, add=residual
    )
    return out, GdnRecord(conv_input, a, b, state, rec, record)


def gated_norm(norm: nn.Module, y: mx.array, z: mx.array, impl: str) -> mx.array:
    """``norm(y, z)`` (mlx-lm's ``Qwen3NextRMSNormGated``): with the fused kernel
    (``impl == "cuda"``) and ``select.gated_norm_enabled()``, one launch of the same bits
    (:func:`hf2q.kernels.cuda_norm.gated_norm_cuda`) where it takes the shapes; else the module."""
    if impl == "cuda" and select.gated_norm_enabled():
        weight = norm.weight
        if cuda_norm.supported(y, z, weight) is None:
            return cuda_norm.gated_norm_cuda(y, z, weight, norm.eps)
    return norm(y, z)


def gdn_decoder_layer(
    layer: nn.Module,
    x: mx.array,
    conv_state: mx.array | None,
    state: mx.array | None,
    *,
    impl: str = "ops",
    record: str = "states",
    fused: FusedProjections | None = None,
    mm: bool = False,
) -> tuple[mx.array, GdnRecord]:
    """A whole Qwen3.5 linear-attention ``DecoderLayer``: norm, mixer, residual, norm, MLP, residual.

    ``fused`` (from :func:`fuse_projections`) replaces the six input matmuls by two; ``mm`` runs
    the products through :func:`hf2q.kernels.linear.linear`.
    """
    h, rec = gdn_mixer(
        layer.linear_attn,
        normed(layer.input_layernorm, x, mm),  # (in the products' launch where it can)
        conv_state,
        state,
        impl=impl,
        record=record,
        in_proj=None if fused is None else fused.in_proj,
        mm=mm,
        residual=x,
    )
    hn = normed(layer.post_attention_layernorm, h, mm)
    if fused is None:
        return swiglu_mlp(layer.mlp, hn, mm, add=h), rec
    return mlp_fused(layer.mlp, fused.gate_up, hn, mm, add=h), rec


def rollback_state(attn: nn.Module, rec: GdnRecord, n: int, *, impl: str = "ops") -> mx.array:
    """Recurrent state after the first ``n`` (1 <= n <= T) tokens of the recorded block, exactly.

    Per-step records return a view; final-state records replay ``n`` steps from ``state0``
    (nothing when ``n == T``). ``impl`` picks the replay implementation (as in :func:`gdn_mixer`).
    """
    T = rec.steps
    if not 1 <= n <= T:
        raise ValueError(f"can keep 1..{T} tokens of this block, not {n}")
    if rec.record == "states":
        return rec.rec[:, n - 1]
    if n == T:
        return rec.rec
    return _rerun(attn, rec, impl=impl, record="final", steps=n)


def _rerun(attn: nn.Module, rec: GdnRecord, **kw: Any):
    """:func:`_recurrence` over the recorded block again, from the state before it."""
    return _recurrence(
        attn, rec.conv_state, rec.qkv, rec.conv_input, rec.a, rec.b, rec.state0, **kw
    )


def replay_rows(attn: nn.Module, rec: GdnRecord, keep: mx.array, *, impl: str) -> mx.array:
    """Row b's recurrent state after its own first ``keep[b]`` (1..T) tokens of the recorded
    block, exactly: (B, Hv, Dv, Dk). Per-step records gather; final-state records replay each
    row's count from ``state0`` (CUDA: one launch of the fused kernel, compiled; the other
    implementations compute every step's state and gather, the same bits as their replay)."""
    keep = keep.astype(mx.int32)
    if keep.ndim != 1:  # (a reshape is a graph node even when it changes nothing)
        keep = keep.reshape(-1)
    if rec.record == "final":
        if impl == "cuda":
            return _replay_cuda(attn, rec, keep)
        if impl == "mlx":
            raise ValueError("impl 'mlx' cannot replay a count per row: use the ops or CUDA impl")
        _, states = _rerun(attn, rec, impl=impl, record="states")
    else:
        states = rec.rec
    if isinstance(states, list):
        states = mx.stack(states, axis=1)
    return mx.take_along_axis(states, (keep - 1).reshape(-1, 1, 1, 1, 1), axis=1)[:, 0]


class RowReplay:
    """``replay_rows(attn, rec, keep, impl=impl)`` as a callable of ``keep`` that keeps its
    arguments, so that a rollback can join every layer's replay into one launch
    (:func:`replay_layers`)."""

    __slots__ = ("attn", "rec", "impl")

    def __init__(self, attn: nn.Module, rec: GdnRecord, impl: str) -> None:
        self.attn, self.rec, self.impl = attn, rec, impl

    def __call__(self, keep: mx.array) -> mx.array:
        return replay_rows(self.attn, self.rec, keep, impl=self.impl)


def replay_layers(replays: list[Any], keep: mx.array) -> list[mx.array] | None:
    """Each layer's ``replay(keep)`` in one CUDA launch for all layers
    (:func:`hf2q.kernels.cuda_gated_delta.gdn_replay_layers_cuda`, compiled; the bits of the
    per-layer replays), or None where that does not apply: ``HF2Q_REPLAY_LAYERS=0``, replays
    that are not final-state :class:`RowReplay` on the CUDA implementation, or layers of
    different geometries or shapes (the caller then replays layer by layer)."""
    if not replays or not select.replay_layers_enabled():
        return None
    if not all(
        isinstance(r, RowReplay) and r.impl == "cuda" and r.rec.record == "final" for r in replays
    ):
        return None
    heads = _heads(replays[0].attn)
    if any(_heads(r.attn) != heads for r in replays):
        return None
    args = []
    for r in replays:
        rec, attn = r.rec, r.attn
        args += [rec.conv_input, conv_weight(attn), rec.a, rec.b, attn.A_log, attn.dt_bias]
        args.append(rec.state0)
    try:  # (the kernel's wrapper makes ``keep`` int32 (B,), inside the compiled graph)
        return _replay_layers_fn(len(replays), *heads)(keep, *args)
    except ValueError:  # UnsupportedShape: shapes or dtypes differ between layers
        return None


def _replay_layers_call(L, Hk, Dk, Hv, Dv, keep, *args):
    from hf2q.kernels.cuda_gated_delta import gdn_replay_layers_cuda

    layers = [tuple(args[7 * i : 7 * i + 7]) for i in range(L)]
    dims = dict(num_k_heads=Hk, key_dim=Dk, num_v_heads=Hv, value_dim=Dv)
    return gdn_replay_layers_cuda(layers, keep, **dims)


@functools.cache
def _replay_layers_fn(L: int, Hk: int, Dk: int, Hv: int, Dv: int) -> Callable[..., list]:
    """:func:`_replay_layers_call` for ``L`` layers of one head geometry, compiled on CUDA (a
    custom kernel's Python call rebuilds its source text and ~170 parameters every time; a
    compiled trace replays the node); uncompiled elsewhere (the CPU tests' emulator)."""
    return compiled_on_cuda(functools.partial(_replay_layers_call, L, Hk, Dk, Hv, Dv))


def _replay_cuda(attn: nn.Module, rec: GdnRecord, keep: mx.array) -> mx.array:
    # The record's conv window as it is (the kernel's joined read), not two strided slices.
    args = (rec.conv_input, rec.a, rec.b, rec.state0, keep)
    return _replay_fn(*_heads(attn))(*args, conv_weight(attn), attn.A_log, attn.dt_bias)


def conv_weight(attn: nn.Module) -> mx.array:
    """The depthwise conv weight (C, K) the fused kernel reads: mlx-lm's ``conv1d.weight``
    (C, K, 1) reshaped once and kept (a reshape inside each call is a graph node a layer)."""
    return kept_view(attn.conv1d, "_hf2q_conv2d", lambda w: w.reshape(w.shape[0], -1))


def _heads(attn: nn.Module) -> tuple[int, int, int, int]:
    return attn.num_k_heads, attn.head_k_dim, attn.num_v_heads, attn.head_v_dim


def _fused_call(Hk, Dk, Hv, Dv, conv_state, qkv, a, b, state, steps, conv_w, A_log, dt_bias, **kw):
    """The fused CUDA kernel over a block (``steps``: None, or a replay's count per row;
    ``kw``: ``record`` and ``window`` of :func:`gdn_fused_cuda`)."""
    from hf2q.kernels.cuda_gated_delta import gdn_fused_cuda

    dims = dict(num_k_heads=Hk, key_dim=Dk, num_v_heads=Hv, value_dim=Dv)
    args = (conv_state, qkv, conv_w, a, b, A_log, dt_bias, state)
    return gdn_fused_cuda(*args, **dims, steps=steps, **kw)


def fused_block(
    attn: nn.Module,
    conv_state: mx.array,
    qkv: mx.array,
    a: mx.array,
    b: mx.array,
    state: mx.array,
    *,
    record: str,
) -> tuple[mx.array, mx.array, mx.array]:
    """The fused CUDA kernel over a block: ``(y, record, conv window)``, the window
    ``concatenate([conv_state, qkv], axis=1)`` written by the launch itself
    (``select.gdn_window_enabled()``; else that concatenate: two copy launches a layer)."""
    args = (conv_state, qkv, a, b, state, None, conv_weight(attn), attn.A_log, attn.dt_bias)
    if select.gdn_window_enabled():
        return _fused_call(*_heads(attn), *args, record=record, window=True)
    y, rec = _fused_call(*_heads(attn), *args, record=record)
    return y, rec, mx.concatenate([conv_state, qkv], axis=1)


def _replay_call(Hk, Dk, Hv, Dv, conv_input, a, b, state, steps, conv_w, A_log, dt_bias):
    """The fused kernel's replay of ``steps`` (per row) from ``state`` over a record's whole
    conv window ``conv_input`` (B, K-1+T, C)."""
    return _fused_call(
        Hk, Dk, Hv, Dv, None, conv_input, a, b, state, steps, conv_w, A_log, dt_bias, record="final"
    )


@functools.cache
def _replay_fn(Hk: int, Dk: int, Hv: int, Dv: int) -> Callable[..., mx.array]:
    """:func:`_replay_call` for one head geometry, compiled (weights as inputs, so every layer
    shares the trace): a custom kernel's Python call rebuilds its source text every time, a
    compiled trace's replay does not (docs/BENCHMARKS.md, session 14)."""
    return mx.compile(functools.partial(_replay_call, Hk, Dk, Hv, Dv))


def rollback(
    attn: nn.Module, rec: GdnRecord, n: int, *, impl: str = "ops"
) -> tuple[mx.array, mx.array]:
    """``(conv_state, state)`` of the layer after keeping the first ``n`` tokens of the block."""
    return rec.conv_state_after(n), rollback_state(attn, rec, n, impl=impl)


# -- compiled layers -----------------------------------------------------------------------------

LayerRunner = Callable[[mx.array, mx.array, mx.array], tuple[mx.array, GdnRecord]]


def compile_gdn_decoder_layer(
    layer: nn.Module,
    *,
    impl: str,
    record: str,
    fused: FusedProjections | None = None,
    mm: bool = False,
) -> LayerRunner:
    """``mx.compile`` of :func:`gdn_decoder_layer` for one layer.

    The caller keeps the returned function as long as the model (one trace per input shape,
    e.g. T=1 for decode and T=16 for verify); it holds the layer only weakly, so the model must
    stay alive while it is used. Inputs must be arrays (no None).
    """
    ref = weakref.ref(layer)

    def fn(x: mx.array, conv_state: mx.array, state: mx.array):
        out, rec = gdn_decoder_layer(
            _alive(ref), x, conv_state, state, impl=impl, record=record, fused=fused, mm=mm
        )
        # Inputs are not returned from the compiled graph; the record is rebuilt outside.
        return out, rec.conv_input, rec.a, rec.b, rec.rec

    cfn = mx.compile(fn)

    def run(x: mx.array, conv_state: mx.array, state: mx.array) -> tuple[mx.array, GdnRecord]:
        out, conv_input, a, b, r = cfn(x, conv_state, state)
        return out, GdnRecord(conv_input, a, b, state, r, record)

    return run


def compile_post_attention(layer: nn.Module) -> Callable[[mx.array, mx.array], mx.array]:
    """``mx.compile`` of what follows the attention of a decoder layer: residual, norm, MLP, residual."""
    ref = weakref.ref(layer)

    def fn(x: mx.array, r: mx.array) -> mx.array:
        lay = _alive(ref)
        h = x + r
        return h + lay.mlp(lay.post_attention_layernorm(h))

    return mx.compile(fn)


def _alive(ref: weakref.ref) -> nn.Module:
    layer = ref()
    if layer is None:
        raise RuntimeError("the layer of this compiled function was freed: keep the model alive")
    return layer


def empty_states(attn: nn.Module, batch: int, dtype: Any) -> tuple[mx.array, mx.array]:
    """Zero ``(conv_state, state)`` for a fresh sequence of ``batch`` rows."""
    return (
        mx.zeros((batch, attn.conv_kernel_size - 1, attn.conv_dim), dtype=dtype),
        mx.zeros((batch, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32),
    )
