"""The verify forward: one target pass over ``[last, d_1 .. d_{B-1}]`` that records what rollback needs.

What it does: :func:`verify_forward` runs the target through ``TargetModel.forward`` with
:func:`verify_layer` as the layer function. Full-attention (and plain Qwen3) layers run their own
mlx-lm ``__call__`` unchanged (their KV cache is trimmed on rollback). Gated-DeltaNet layers are
computed from *that instance's* mlx-lm submodules (projections, conv1d, gated norm, MLP) and
mlx-lm's public helpers (``normalize_qk``, ``compute_g``), with the recurrence from
:func:`hf2q.kernels.gated_delta.gated_delta_steps`, which also returns the state after every step;
the layer stores the conv input window and those states in its :class:`GDNRollbackCache`. On
CUDA, where plain decoding runs hf2q's compiled layers, the verify runs
:func:`runner_verify_layer_fn` instead: the same computation through the compiled whole-layer
runners of :mod:`hf2q.kernels.layers` (fewer graph nodes, less host work per layer).

What it does not do: patch any mlx-lm class, decide acceptance, or roll back (see
``hf2q.runtime.cache``). Tensor parallel (sharded) Gated-DeltaNet layers are not supported here.

Numerics: per layer the output equals mlx-lm's own ``DecoderLayer.__call__`` on the same input
and cache (on the CPU the recurrence is bit-identical to mlx-lm's ops path; on a GPU the kernels
agree to a float32 relative error of 1e-5; tested), so verify logits equal a plain forward over
the same tokens.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from hf2q.kernels import select
from hf2q.kernels.forward import CompiledVerify
from hf2q.kernels.gated_delta import gated_delta_steps
from hf2q.kernels.gdn import LayerRunner, RowReplay, _alive, empty_states, fused_block
from hf2q.kernels.layers import (
    Chosen,
    attention_runnable,
    decode_runners_active,
    gdn_runnable,
    runner_choice,
)
from hf2q.runtime.cache import GDNRollbackCache, TargetCache
from hf2q.runtime.target import TargetModel


def _fused(attn: nn.Module, mask: Any) -> bool:
    """Whether :func:`_gdn_math` runs the fused CUDA kernel (its states come as one array)."""
    return mask is None and select.gdn_impl(attn) == "cuda"


def _gdn_math(
    attn: nn.Module, x: mx.array, conv_state: mx.array, state: mx.array, mask: Any
) -> tuple[mx.array, mx.array, list[mx.array] | mx.array]:
    """mlx-lm's ``GatedDeltaNet.__call__`` math for an unsharded layer, without cache writes.

    Args:
        x: (B, S, H) normed layer input; conv_state (B, K-1, C); state (B, Hv, Dv, Dk) float32.

    Returns:
        ``(out, conv_input, states)``: out (B, S, H) before the residual add; conv_input
        (B, K-1+S, C); the S per-step recurrent states, as a list, or with the fused CUDA kernel
        (:func:`_fused`) as one array (B, S, Hv, Dv, Dk).
    """
    B, S, _ = x.shape
    qkv = attn.in_proj_qkv(x)  # (B, S, 2*key_dim + value_dim)
    z = attn.in_proj_z(x).reshape(B, S, attn.num_v_heads, attn.head_v_dim)
    b = attn.in_proj_b(x)  # (B, S, Hv)
    a = attn.in_proj_a(x)  # (B, S, Hv)
    if _fused(attn, mask):
        # One CUDA kernel for conv + SiLU + q/k norm + gates + recurrence (hf2q.kernels), writing
        # the state after every position into one buffer (the record keeps it whole).
        y, buf, conv_input = fused_block(attn, conv_state, qkv, a, b, state, record="states")
        out = attn.out_proj(attn.norm(y, z).reshape(B, S, -1))
        return out, conv_input, buf
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # (B, K-1+S, C)
    conv_out = nn.silu(attn.conv1d(conv_input))  # (B, S, C)
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)
    beta = mx.sigmoid(b)
    g = compute_g(attn.A_log, a, attn.dt_bias)  # (B, S, Hv) float32
    y, states = gated_delta_steps(q, k, v, g, beta, state, mask)
    out = attn.out_proj(attn.norm(y, z).reshape(B, S, -1))
    return out, conv_input, states


# One compiled ``_gdn_math`` per layer instance (its weights are constants of the traced graph):
# replaying it costs the host far less than rebuilding ~30 ops plus T recurrence steps per call.
# The trace reads ``select.gdn_window_enabled()`` (``fused_block``): an entry keeps the setting it
# was traced with and is rebuilt when the setting changes.
_compiled_layers: dict[int, tuple[weakref.ref, Callable[..., Any], bool]] = {}


def _compiled_gdn(attn: nn.Module) -> Callable[..., Any]:
    k = id(attn)
    window = select.gdn_window_enabled()
    entry = _compiled_layers.get(k)
    if entry is None or entry[0]() is not attn or entry[2] != window:
        # The function holds the layer weakly and its entry goes with the layer: a compiled
        # trace keeps the weights it read, so a kept entry would keep a freed model in memory.
        ref = weakref.ref(attn, lambda _r: _compiled_layers.pop(k, None))

        def flat(x: mx.array, conv_state: mx.array, state: mx.array) -> tuple[mx.array, ...]:
            out, conv_input, states = _gdn_math(_alive(ref), x, conv_state, state, None)
            return (out, conv_input, *([states] if isinstance(states, mx.array) else states))

        entry = (ref, mx.compile(flat), window)
        _compiled_layers[k] = entry
    return entry[1]


def gdn_verify(
    attn: nn.Module, x: mx.array, mask: Any, cache: GDNRollbackCache, *, compiled: bool = True
) -> mx.array:
    """A Gated-DeltaNet (``linear_attn``) forward over ``x`` (B, T, H) that records rollback data.

    Same computation as mlx-lm's ``GatedDeltaNet.__call__`` for an unsharded layer, with the
    recurrence from :func:`gated_delta_steps`. Updates ``cache`` to the state after all T
    positions and stores a :class:`~hf2q.runtime.cache.GDNRecord` in it. Without a mask the
    layer runs as a compiled graph (same results on CPU, bit for bit; tested).

    Returns:
        (B, T, H) the layer's output (before the residual add).
    """
    if getattr(attn, "sharding_group", None) is not None:
        raise NotImplementedError(
            "verify of tensor-parallel Gated-DeltaNet layers is not supported"
        )
    if cache.lengths is not None:
        raise NotImplementedError("verify does not support right-padded (lengths) caches")
    B, S, _ = x.shape
    K1 = attn.conv_kernel_size - 1
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, K1, attn.conv_dim), dtype=x.dtype)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32)
    if compiled and mask is None and select.compile_enabled():
        res = _compiled_gdn(attn)(x, conv_state, state)
        out, conv_input = res[0], res[1]
        states = res[2] if _fused(attn, None) else list(res[2:])
    else:
        out, conv_input, states = _gdn_math(attn, x, conv_state, state, mask)
    cache.set_record(conv_input, states)
    cache[0] = mx.contiguous(conv_input[:, -K1:])
    cache[1] = cache.record.after(S)
    cache.advance(S)
    return out


def _runner_verify(
    layer: nn.Module, impl: str, run: LayerRunner, h: mx.array, cache: GDNRollbackCache
) -> mx.array:
    """A Gated-DeltaNet decoder layer over a verify block through its compiled whole-layer runner
    ``run`` (:func:`hf2q.kernels.layers.gdn_layer_runner` recording per-step states, or where
    ``select.gdn_record`` says ``final`` the final state and what a replay needs), as plain
    decoding runs the same layer with :func:`hf2q.kernels.layers.decode_layer_fn`."""
    conv, state = cache[0], cache[1]
    if conv is None or state is None:
        conv, state = empty_states(layer.linear_attn, h.shape[0], h.dtype)
    out, rec = run(h, conv, state)
    if rec.record == "final":
        attn = layer.linear_attn
        replay = RowReplay(attn, rec, impl)
        cache.set_record(rec.conv_input, rec.rec, replay=replay, steps=rec.steps)
    else:
        cache.set_record(rec.conv_input, rec.rec)  # rec.rec: (B, T, Hv, Dv, Dk)
    cache[0] = mx.contiguous(rec.final_conv_state)
    cache[1] = rec.final_state
    cache.advance(h.shape[1])
    return out


def _runnable(layer: nn.Module, cache: Any) -> bool:
    """Whether a layer can go through the compiled runners (as plain decoding's layer function
    decides; Gated-DeltaNet layers also need a cache that records for rollback)."""
    if getattr(layer, "is_linear", False):
        return isinstance(cache, GDNRollbackCache) and gdn_runnable(layer, cache)
    return attention_runnable(layer, cache)


def verify_layer(index: int, layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
    """``TargetModel.forward`` layer function for verify: records Gated-DeltaNet layers.

    Layers without a :class:`GDNRollbackCache` (attention, plain Qwen3) run their own
    ``__call__``. For Gated-DeltaNet decoder layers this is mlx-lm's ``DecoderLayer.__call__``
    (pre-norm, residual, MLP or MoE block) with :func:`gdn_verify` in place of ``linear_attn``.
    """
    if not (getattr(layer, "is_linear", False) and isinstance(cache, GDNRollbackCache)):
        return layer(h, mask=mask, cache=cache)
    r = gdn_verify(layer.linear_attn, layer.input_layernorm(h), mask, cache)
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h))


def runner_verify_layer_fn(
    *, fuse_proj: bool = False, mm: bool = False, rows: bool = False, record: str = "states"
) -> Callable[..., mx.array]:
    """:func:`verify_layer` with the compiled whole-layer runners of ``hf2q.kernels.layers``.

    Gated-DeltaNet layers (no padding mask) run :func:`_runner_verify`, full-attention layers
    :func:`~hf2q.kernels.layers.attention_runner` (over any cache with mlx-lm's protocol, e.g.
    the slot and bucketed caches); anything else falls back to :func:`verify_layer`. Same math,
    fewer graph nodes and far less host work per layer, which is what bounds a small model's
    round on a GPU. ``fuse_proj``: the runners' concatenated projections (``HF2Q_FUSE_PROJ``);
    ``mm``: their products through the small-M kernel (``select.small_mm_enabled()``);
    ``rows``: attention through the row-invariant kernel (``select.row_attention_enabled()``), as
    plain decoding's steps, so that each verify row computes what its decode step computes;
    ``record``: what the Gated-DeltaNet layers keep for the rollback (``select.gdn_record(bytes)``).
    """

    chosen = Chosen()
    choose = runner_choice(fuse_proj=fuse_proj, mm=mm, rows=rows, record=record)

    def run(index: int, layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
        if not _runnable(layer, cache):
            return verify_layer(index, layer, h, mask, cache)
        impl, runner = chosen.get(layer, choose)
        if not getattr(layer, "is_linear", False):
            return runner(h, mask, cache)
        # Padding masks, and Apple GPUs' mlx-lm kernel (final state only), keep the layer call.
        if mask is not None or runner is None:
            return verify_layer(index, layer, h, mask, cache)
        return _runner_verify(layer, impl, runner, h, cache)

    return run


_verify_fns: dict[tuple, Callable[..., mx.array]] = {}


def use_runners() -> bool:
    """Whether verify runs the compiled layer runners here: where plain decoding does (CUDA,
    ``HF2Q_KERNELS`` not ``ops``, ``HF2Q_COMPILE`` on), so that both compute alike."""
    return decode_runners_active() and select.compile_enabled()


def whole_verify(
    target: TargetModel, cache: TargetCache, block: int, capture: Sequence[int] = ()
) -> CompiledVerify | None:
    """The verify forward of full blocks (``block`` tokens a row, one sequence or a slot cache's
    rows) as one compiled graph (:class:`~hf2q.kernels.forward.CompiledVerify`), for
    :func:`verify_forward`'s ``whole``; None where the layer path runs instead: where verify does
    not run the layer runners (:func:`use_runners`), ``HF2Q_COMPILE_VERIFY=0``, layers or caches
    the graph does not compute (a prefilled ``cache`` is asked), or where its bits would not be
    the layer path's (MLX's attention; ``HF2Q_COMPILE_VERIFY=1`` forces it there). Decided once a
    generation, with the settings the layer path reads on each call (:func:`verify_forward`)."""
    if not (use_runners() and select.compile_verify_enabled()):
        return None
    rows = select.row_attention_enabled()
    if not CompiledVerify.supports(target, cache):
        return None
    if not (select.compile_verify_forced() or CompiledVerify.exact(target, rows)):
        return None
    return CompiledVerify(
        target,
        fuse_proj=select.fuse_proj_enabled(),
        mm=select.small_mm_enabled(),
        rows=rows,
        capture=capture,
        block=block,
    )


def verify_forward(
    target: TargetModel,
    tokens: mx.array,
    cache: TargetCache,
    *,
    capture: Sequence[int] = (),
    runners: bool | None = None,
    lagged: bool = False,
    whole: CompiledVerify | None = None,
) -> tuple[mx.array, mx.array | None]:
    """Run the target over ``tokens`` (B, T) so that ``cache.rollback(n_keep)`` can follow.

    Args:
        runners: use :func:`runner_verify_layer_fn` (True) or :func:`verify_layer` (False);
            None: :func:`use_runners`.
        lagged: the forward is a lagged round's (``hf2q.runtime.slots``): its graph is queued
            every ``select.flush_layers(lagged=True)`` layers as it is built (``whole``'s graph
            as soon as it is built, unless that is 0).
        whole: from :func:`whole_verify`: blocks of its length, capturing what it captures, run
            as its one compiled graph (shorter ones, a generation's last, keep the layer path
            rather than trace another graph).

    Returns:
        ``(logits, features)`` as :meth:`TargetModel.forward`: logits (B, T, vocab) and the
        captured layer outputs (B, T, len(capture)*H) or None.
    """
    cache.begin_verify(tokens.shape[1])
    if whole is not None and tokens.shape[1] == whole.block and tuple(capture) == whole.capture:
        out = whole(tokens, cache)
        if select.flush_layers(lagged):
            # Queued as soon as it is built, as the layer path queues its layers: the device runs
            # the verify while the host builds the acceptance and the rollback.
            mx.async_eval([a for a in out if a is not None])
        return out
    mm = select.small_mm_enabled()  # read once a forward, for the layers and the head
    if use_runners() if runners is None else runners:
        record_bytes = tokens.size * target.gdn_state_size * 4  # a layer's float32 step states
        options = (
            select.fuse_proj_enabled(),
            mm,
            select.row_attention_enabled(),
            select.gdn_record(record_bytes),
        )
        # One layer function per set of settings, kept across rounds with its per-layer choices.
        key = (
            *options,
            select.mm_key(),
            select.trace_key(),
            select.kernel_mode(),
            select.backend(),
            select.compile_enabled(),
        )
        fn = _verify_fns.get(key)
        if fn is None:
            fn = _verify_fns[key] = runner_verify_layer_fn(
                fuse_proj=options[0], mm=options[1], rows=options[2], record=options[3]
            )
    else:
        fn = verify_layer
    return target.forward(
        tokens,
        cache,
        capture=capture,
        layer_fn=fn,
        mm=mm,
        flush_every=select.flush_layers(lagged),
    )
