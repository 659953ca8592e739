"""Compiled layer runners cached per layer, and a fast layer function for ``TargetModel.forward``.

What it does: :func:`gdn_layer_runner` and :func:`attention_runner` return the compiled runner of
one mlx-lm decoder layer (:mod:`hf2q.kernels.gdn`, :mod:`hf2q.kernels.attention`), built once
per (layer, options) and dropped when the layer is freed. :func:`fast_layer_fn` is a
``layer_fn(index, layer, h, mask, cache)`` that runs every layer of a Qwen3.5 target through them
and updates mlx-lm's own caches exactly as the layers' own ``__call__`` would (``ArraysCache``
conv/recurrent state, ``KVCache``), so plain decoding can use it in place of the model's forward.

What it does not do: record anything for rollback (the verify path keeps records), or handle
padding masks, quantized KV caches, sharded layers or other architectures: those layers run their
own ``__call__``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from hf2q.kernels import select
from hf2q.kernels.attention import compile_attention_layer
from hf2q.kernels.gdn import (
    FusedProjections,
    LayerRunner,
    compile_gdn_decoder_layer,
    empty_states,
    fuse_projections,
    gdn_decoder_layer,
)

_RUNNERS: dict[tuple, tuple[weakref.ref, Callable]] = {}
#: Longest block the ops recurrence is compiled for (longer ones run the layer's own call).
MAX_OPS_STEPS = 64


def _cached(layer: nn.Module, key: tuple, build: Callable[[], Any]) -> Any:
    k = (id(layer), *key)
    hit = _RUNNERS.get(k)
    if hit is not None and hit[0]() is layer:
        return hit[1]
    ref = weakref.ref(layer, lambda _r, k=k: _RUNNERS.pop(k, None))
    fn = build()
    _RUNNERS[k] = (ref, fn)
    return fn


class Chosen:
    """What each layer of a model runs, decided once per layer function instead of on every call.

    A layer function (plain decoding's :func:`fast_layer_fn`, verify's runner function) used to
    ask on every call which implementation a layer takes and look its compiled runner up: for a
    32-layer model on an H200 that was about half a millisecond of each step's host time
    (environment reads, device queries, the runner cache; docs/BENCHMARKS.md, session 15). The
    choice depends on the layer and on settings read when the layer function is made; the
    per-call conditions (mask, cache kind, block length) are still checked on every call.
    """

    def __init__(self) -> None:
        self._by_layer: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, layer: nn.Module, choose: Callable[[nn.Module], Any]) -> Any:
        """``choose(layer)``, computed on this layer's first call and kept while it lives (the
        entry goes with the layer: a kept compiled runner would keep the model's weights)."""
        k = id(layer)
        hit = self._by_layer.get(k)
        if hit is not None and hit[0]() is layer:
            return hit[1]
        value = choose(layer)
        self._by_layer[k] = (weakref.ref(layer, lambda _r: self._by_layer.pop(k, None)), value)
        return value

    def __len__(self) -> int:
        return len(self._by_layer)


def runner_choice(
    *, fuse_proj: bool, mm: bool, rows: bool, record: str
) -> Callable[[nn.Module], tuple[str | None, Callable | None]]:
    """``choose(layer) -> (impl, runner)`` for :class:`Chosen`: a Gated-DeltaNet layer's
    implementation and compiled runner (recording ``record``; no runner for ``"mlx"``, Apple
    GPUs' kernel, which the layer's own call runs), a Qwen3.5 attention layer's runner, or
    ``(None, None)`` for layers the runners do not cover."""

    def choose(layer: nn.Module) -> tuple[str | None, Callable | None]:
        if getattr(layer, "is_linear", False):
            impl = select.gdn_impl(layer.linear_attn)
            if impl == "mlx":
                return impl, None
            runner = gdn_layer_runner(layer, impl=impl, record=record, fuse_proj=fuse_proj, mm=mm)
            return impl, runner
        if isinstance(getattr(layer, "self_attn", None), Qwen3NextAttention):
            return None, attention_runner(layer, fuse_proj=fuse_proj, mm=mm, rows=rows)
        return None, None

    return choose


def _has_plain_mlp(layer: nn.Module) -> bool:
    return hasattr(layer.mlp, "gate_proj") and hasattr(layer.mlp, "up_proj")


def fused_projections(layer: nn.Module, fuse_proj: bool) -> FusedProjections | None:
    """The Gated-DeltaNet layer's concatenated projections when ``fuse_proj`` applies to it (a
    plain MLP), else None: one copy per layer, shared by its decode and verify runners and the
    compiled decode step."""
    if not (fuse_proj and _has_plain_mlp(layer)):
        return None
    return _cached(layer, ("fused-proj",), lambda: fuse_projections(layer))


def gdn_layer_runner(
    layer: nn.Module, *, impl: str, record: str, fuse_proj: bool = False, mm: bool = False
) -> LayerRunner:
    """The compiled runner ``(x, conv_state, state) -> (out, GdnRecord)`` of a linear-attention layer."""
    fuse = fuse_proj and _has_plain_mlp(layer)
    compiled = select.compile_enabled()

    def build() -> LayerRunner:
        fused = fused_projections(layer, fuse)
        if compiled:
            return compile_gdn_decoder_layer(layer, impl=impl, record=record, fused=fused, mm=mm)
        ref = weakref.ref(layer)
        return lambda x, conv, state: gdn_decoder_layer(
            ref(), x, conv, state, impl=impl, record=record, fused=fused, mm=mm
        )

    products = select.mm_key() if mm else None  # read by the trace (``linear``, ``linears``)
    traced = select.trace_key() if impl == "cuda" else None  # read by the trace (``gdn_mixer``)
    return _cached(layer, ("gdn", impl, record, fuse, compiled, mm, products, traced), build)


def attention_runner(
    layer: nn.Module, *, fuse_proj: bool = False, mm: bool = False, rows: bool = False
) -> Callable:
    """The compiled runner ``(x, mask, cache) -> out`` of a full-attention layer (``rows``: the
    row-invariant attention kernel, see :func:`~hf2q.kernels.attention.compile_attention_layer`)."""
    fuse = fuse_proj and _has_plain_mlp(layer)
    if not select.compile_enabled():
        ref = weakref.ref(layer)
        return _cached(layer, ("attn-plain",), lambda: lambda x, mask, cache: ref()(x, mask, cache))
    return _cached(
        layer,
        ("attn", fuse, mm, rows, select.mm_key() if mm else None, select.trace_key()),
        lambda: compile_attention_layer(layer, fuse_proj=fuse, mm=mm, rows=rows),
    )


def gdn_runnable(layer: nn.Module, cache: Any) -> bool:
    """Whether a Gated-DeltaNet decoder layer can go through :func:`gdn_layer_runner`: an
    unsharded layer over an ``ArraysCache`` without padded lengths."""
    return (
        isinstance(cache, ArraysCache)
        and cache.lengths is None
        and getattr(layer.linear_attn, "sharding_group", None) is None
    )


def attention_runnable(layer: nn.Module, cache: Any) -> bool:
    """Whether a decoder layer is a Qwen3.5 full-attention layer :func:`attention_runner` takes:
    over mlx-lm's ``KVCache`` or any cache with its protocol (hf2q's slot and bucketed caches)."""
    return isinstance(getattr(layer, "self_attn", None), Qwen3NextAttention) and hasattr(
        cache, "update_and_fetch"
    )


def fast_layer_fn(
    *, fuse_proj: bool = False, mm: bool = False, rows: bool = False
) -> Callable[[int, nn.Module, mx.array, Any, Any], mx.array]:
    """A ``TargetModel.forward`` layer function using the compiled runners (and CUDA kernels).

    Args:
        fuse_proj: concatenate each layer's input projections once (one matmul instead of
            several; costs a copy of those weights).
        mm: run the layers' products through :func:`hf2q.kernels.linear.linear`
            (``select.small_mm_enabled()``: the small-M tensor-core kernel on CUDA).
        rows: full attention through the row-invariant kernel (``select.row_attention_enabled()``).
    """

    chosen = Chosen()
    choose = runner_choice(fuse_proj=fuse_proj, mm=mm, rows=rows, record="final")

    def run(index: int, layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
        impl, runner = chosen.get(layer, choose)
        if getattr(layer, "is_linear", False):
            attn = layer.linear_attn
            if mask is not None or runner is None or not gdn_runnable(layer, cache):
                return layer(h, mask=mask, cache=cache)
            if impl == "ops" and h.shape[1] > MAX_OPS_STEPS:
                # Long prompts on ops: tracing thousands of steps costs more than it saves.
                return layer(h, mask=mask, cache=cache)
            conv, state = cache[0], cache[1]
            if conv is None or state is None:
                conv, state = empty_states(attn, h.shape[0], h.dtype)
            out, rec = runner(h, conv, state)
            cache[0], cache[1] = rec.final_conv_state, rec.final_state
            cache.advance(h.shape[1])
            return out
        if runner is not None and hasattr(cache, "update_and_fetch"):
            return runner(h, mask, cache)
        return layer(h, mask=mask, cache=cache)

    return run


def decode_layer_fn() -> Callable[[int, nn.Module, mx.array, Any, Any], mx.array] | None:
    """The plain decode step's layer function: the compiled runners on CUDA, else None.

    On an NVIDIA GPU mlx-lm runs the Gated-DeltaNet recurrence as a loop of small ops (off Apple
    GPUs); the compiled runners with the fused kernel decode the same model about 1.8x faster
    (docs/BENCHMARKS.md, verify_cost on the H200), and verify uses the same kernel, so plain and
    DFlash decoding compute alike. Elsewhere (``HF2Q_KERNELS=ops``, CPU, Apple GPUs) None: plain
    decoding is mlx-lm's own model call.
    """
    if not decode_runners_active():
        return None
    return fast_layer_fn(
        fuse_proj=select.fuse_proj_enabled(),
        mm=select.small_mm_enabled(),
        rows=select.row_attention_enabled(),
    )


def prefill_layer_fn() -> Callable[[int, nn.Module, mx.array, Any, Any], mx.array] | None:
    """The layer function for a prompt's chunks: the compiled runners where plain decoding runs
    them unless ``HF2Q_PREFILL_RUNNERS=0`` (:func:`hf2q.kernels.select.prefill_runners_enabled`),
    else None (the model's own layer calls).

    Attention keeps MLX's (cuDNN's on CUDA) kernel for the chunk's many query rows instead of the
    row-invariant one, which is built for a decode step's or a verify block's few rows.
    """
    if not decode_runners_active() or not select.prefill_runners_enabled():
        return None
    return fast_layer_fn(
        fuse_proj=select.fuse_proj_enabled(), mm=select.small_mm_enabled(), rows=False
    )


def decode_runners_active() -> bool:
    """Whether plain decoding runs the compiled runners here (:func:`decode_layer_fn`): on CUDA
    unless ``HF2Q_KERNELS=ops``."""
    return select.backend() == "cuda" and select.kernel_mode() != "ops"
