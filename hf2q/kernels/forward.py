"""A whole plain decode step, and a whole verify forward, of a Qwen3.5 target as one ``mx.compile`` graph.

Why: on an H200 a Qwen3.5-4B-sized decode step is bound by the host, and about 2 ms of its
5.5 ms is Python building the graph layer by layer (docs/BENCHMARKS.md, "H200, session 15"),
even with every layer's math compiled. Replaying one compiled graph for the whole step builds the
same nodes from C++ instead.

What it does: :class:`CompiledDecode` runs one token through every layer of the target in one
compiled function: the Gated-DeltaNet layers as :func:`hf2q.kernels.gdn.gdn_decoder_layer`, the
full-attention layers as :func:`hf2q.kernels.attention.attention_pieces` around the KV cache,
which is written by a scatter at the position given as an array and read whole (the
row-invariant CUDA kernel, or MLX's attention with the positions after the token masked). The
position is an input, so one trace serves every step until mlx-lm's KV buffer grows (every 256
positions), when the cache's shape, hence the trace, changes; the compiled step is kept per target
and settings, so later generations replay its traces. The caches stay mlx-lm's own objects
(``ArraysCache`` states, ``KVCache`` buffers and offset), updated after each call.

:class:`CompiledVerify` does the same for a DFlash verify forward: a block of T tokens, for one
sequence or for every row of a slot cache (a position per row), through every layer, each
Gated-DeltaNet layer keeping what exact rollback needs (the record
:func:`hf2q.runtime.verify.verify_forward` keeps through the layer runners), the KV rows written
at the rows' positions, the drafter's target features captured.

What they do not do: quantized or rotating KV caches, padding, other architectures, and for the
decode step slots (``supports`` says no, and the caller keeps the layer path).

Plain decoding takes the step where the runners run (CUDA) and its bits equal the layer path's
(:meth:`CompiledDecode.exact`: the row-invariant attention kernel); ``HF2Q_COMPILE_FORWARD=0`` turns
it off, ``=1`` forces it wherever it runs. On an H200 it made the 4B-shaped bf16 step 4.30 against
5.09 ms (docs/BENCHMARKS.md, session 38). DFlash's rounds verify their full blocks through the
verify graph by the same rule (``HF2Q_COMPILE_VERIFY``, :func:`hf2q.runtime.verify.whole_verify`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from hf2q.kernels import cuda_attention, select
from hf2q.kernels.attention import attention_pieces
from hf2q.kernels.gdn import GdnRecord, RowReplay, gdn_decoder_layer
from hf2q.kernels.layers import fused_projections, gdn_runnable

#: The least a compiled graph's KV buffers grow by (positions), and the rounding of their size.
GRAPH_GROW, GRAPH_STEP = 1024, 256


def graph_capacity(need: int, have: int) -> int:
    """The buffer size (positions) to grow a KV buffer of ``have`` positions to when a compiled
    graph needs ``need``: at least ``need``, and at least half again ``have`` or
    :data:`GRAPH_GROW` more, in steps of :data:`GRAPH_STEP`.

    Why: a graph's trace depends on its buffers' shapes, so each growth traces the whole model
    again (20-49 ms of host time against 3-4 to replay for an 8-layer target on this
    repository's CPU host, ``benchmarks/forward_build.py --retrace``, session 40; several times
    that for 32 layers), while the layer path's compiled pieces never see the buffer. mlx-lm
    grows by 256 positions: a retrace every 256 tokens of plain decoding, or every ~50 rounds of
    DFlash at tau 5, each costing what those rounds save. Growing by at least 1024 or half the
    buffer makes retraces rare (logarithmic in the context) for at most half again the KV memory;
    the bits do not depend on it (the row-invariant kernel reads each row up to its position).
    """
    size = max(need, have + max(GRAPH_GROW, have // 2))
    return -(-size // GRAPH_STEP) * GRAPH_STEP


def _reserve(cache: KVCache, n: int) -> None:
    """Make room for ``n`` more positions in ``cache``'s buffers (growing them by
    :func:`graph_capacity`, zeros past the held positions as mlx-lm's own growth leaves them), so
    the compiled graph can write them in place."""
    have = cache.keys.shape[2]
    if cache.offset + n <= have:
        return
    grow = graph_capacity(cache.offset + n, have) - have
    B, heads, _, dk = cache.keys.shape
    dv = cache.values.shape[3]
    cache.keys = mx.concatenate([cache.keys, mx.zeros((B, heads, grow, dk), cache.keys.dtype)], 2)
    cache.values = mx.concatenate(
        [cache.values, mx.zeros((B, heads, grow, dv), cache.values.dtype)], 2
    )


def _traced_settings() -> tuple:
    """The settings a whole-model trace reads besides its arguments (its cache key's rest)."""
    return (
        select.mm_key(),
        select.trace_key(),
        select.kernel_mode(),
        select.backend(),
        select.compile_enabled(),
    )


def _parts(target: Any, fuse_proj: bool, mm: bool, rows: bool) -> list[tuple]:
    """Per layer of ``target``: ``("gdn", layer, impl, fused projections or None)`` or
    ``("attn", AttentionPieces)``, what a whole-model trace runs."""
    parts: list[tuple] = []
    for layer in target.layers:
        if getattr(layer, "is_linear", False):
            impl = select.gdn_impl(layer.linear_attn)
            parts.append(("gdn", layer, impl, fused_projections(layer, fuse_proj)))
        else:
            parts.append(("attn", attention_pieces(layer, fuse_proj=fuse_proj, mm=mm, rows=rows)))
    return parts


def _gdn_layer(part: tuple, h: mx.array, conv: mx.array, state: mx.array, record: str, mm: bool):
    """A ``("gdn", ...)`` part of :func:`_parts` over ``h``: ``(out, GdnRecord)``."""
    _, layer, impl, fused = part
    return gdn_decoder_layer(layer, h, conv, state, impl=impl, record=record, fused=fused, mm=mm)


def _supported(target: Any, cache: Sequence[Any], gdn_cache: type, kv_caches: tuple) -> bool:
    """Whether every layer and cache is one a whole-model trace computes: Gated-DeltaNet layers
    the runners take over a ``gdn_cache`` holding states (not Apple GPUs' kernel), Qwen3.5
    attention layers over a cache of exactly one of ``kv_caches`` holding positions."""
    for layer, c in zip(target.layers, cache, strict=True):
        if getattr(layer, "is_linear", False):
            if not (isinstance(c, gdn_cache) and gdn_runnable(layer, c)):
                return False
            if c[0] is None or c[1] is None or select.gdn_impl(layer.linear_attn) == "mlx":
                return False
        elif not (
            isinstance(getattr(layer, "self_attn", None), Qwen3NextAttention)
            and type(c) in kv_caches
            and c.keys is not None
        ):
            return False
    return True


def held_position(cache: KVCache, n: int, offset: int | None) -> int:
    """``cache``'s position, its buffers made room for ``n`` more (:func:`_reserve`); every
    attention layer must be at ``offset``, the first layer's (None: this is the first)."""
    _reserve(cache, n)
    if offset is not None and cache.offset != offset:
        raise ValueError("attention caches at different positions")
    return cache.offset


# One traced step per target and settings, kept while the target lives: a plain generation
# after the first replays it instead of tracing the whole model again.
_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_for(target: Any, fuse_proj: bool, mm: bool, rows: bool) -> tuple[list[tuple], Any]:
    """``(parts, compiled step)`` of ``target`` for these settings (see :class:`CompiledDecode`)."""
    per = _steps.setdefault(target, {})
    key = (fuse_proj, mm, rows, *_traced_settings())
    hit = per.get(key)
    if hit is not None:
        return hit
    parts = _parts(target, fuse_proj, mm, rows)
    ref = weakref.ref(target)  # the kept step must not keep its target alive

    def step(tokens: mx.array, offset: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        # arrays: two per layer: (conv, state) of a Gated-DeltaNet layer, (keys, values) buffers
        # of an attention layer; returned updated, after the logits.
        t = ref()
        h = t.embed(tokens)
        at = offset.reshape(1, 1, 1, 1)  # where each attention layer writes its key and value
        out: list[mx.array] = []
        for i, part in enumerate(parts):
            a, b = arrays[2 * i], arrays[2 * i + 1]
            if part[0] == "gdn":
                h, rec = _gdn_layer(part, h, a, b, "final", mm)
                out += [rec.final_conv_state, rec.final_state]
                continue
            pieces = part[1]
            q, k, v, gate = pieces.pre(h, offset)
            # A scatter at the position: MLX's CUDA slice update at an array position is a
            # general strided copy of about 19 us a write on the H200 (session 38), a scatter
            # about 3 (session 27); the same values either way.
            a = mx.put_along_axis(a, at, k, axis=2)
            b = mx.put_along_axis(b, at, v, axis=2)
            if rows and cuda_attention.supported(q, a, b) is None:
                o = pieces.attend_rows(q, a, b, offset.reshape(1), gate)
                h = pieces.post_rows(h, o, gate)
            else:  # the buffer whole, positions after this token masked out
                valid = (mx.arange(a.shape[2]) <= offset).reshape(1, 1, 1, -1)
                o = mx.fast.scaled_dot_product_attention(q, a, b, scale=pieces.scale, mask=valid)
                h = pieces.post(h, o, gate)
            out += [a, b]
        return (t.logits(h, mm), *out)

    hit = per[key] = (parts, mx.compile(step))
    return hit


class CompiledDecode:
    """One decode step (one token, one sequence) of ``target`` as one compiled graph.

    Args:
        target: a :class:`hf2q.runtime.target.TargetModel` of a Qwen3.5 model.
        fuse_proj, mm, rows: as :func:`hf2q.kernels.layers.fast_layer_fn`'s (concatenated
            projections, the small-M product kernel, the row-invariant attention kernel).
    """

    def __init__(
        self, target: Any, *, fuse_proj: bool = False, mm: bool = False, rows: bool = False
    ):
        self._parts, self._fn = _step_for(target, fuse_proj, mm, rows)

    @staticmethod
    def supports(target: Any, cache: Sequence[Any]) -> bool:
        """Whether every layer and cache is one this step computes (else use the layer path)."""
        return _supported(target, cache, ArraysCache, (KVCache,))

    @staticmethod
    def exact(target: Any, rows: bool) -> bool:
        """Whether this step's logits have the layer path's bits: where every attention layer
        attends with the row-invariant kernel (``rows`` on, bf16/fp16 weights, heads it takes),
        which reads the buffer up to the position either way. Elsewhere the step attends with
        MLX's attention over the whole buffer, later positions masked out, which need not round
        as the layer path's attention over the used slice does (float32 on an H200 differed at
        the 7th step, session 38); DFlash's verify takes the layer path, so plain decoding keeps
        it there too."""
        if not rows:
            return False
        dtype = target.dtype  # the activations', so the KV buffers'
        for layer in target.layers:
            if getattr(layer, "is_linear", False):
                continue
            sa = getattr(layer, "self_attn", None)
            if sa is None:
                return False
            q = mx.zeros((1, sa.num_attention_heads, 1, sa.head_dim), dtype)
            kv = mx.zeros((1, sa.num_key_value_heads, 1, sa.head_dim), dtype)
            if cuda_attention.supported(q, kv, kv) is not None:
                return False
        return True

    def __call__(self, tokens: mx.array, cache: Sequence[Any]) -> mx.array:
        """Logits (1, 1, vocab) of ``tokens`` (1, 1); ``cache`` advanced by one position."""
        arrays: list[mx.array] = []
        offset = None
        for part, c in zip(self._parts, cache, strict=True):
            if part[0] == "gdn":
                arrays += [c[0], c[1]]
                c[0] = c[1] = None  # the graph holds the only reference: updated in place
            else:
                offset = held_position(c, 1, offset)
                arrays += [c.keys, c.values]
                c.keys = c.values = None
        res = self._fn(tokens, mx.array(offset or 0, dtype=mx.int32), *arrays)
        del arrays
        for i, (part, c) in enumerate(zip(self._parts, cache, strict=True)):
            a, b = res[1 + 2 * i], res[2 + 2 * i]
            if part[0] == "gdn":
                c[0], c[1] = a, b
                c.advance(1)
            else:
                c.keys, c.values = a, b
                c.offset += 1
        return res[0]


# One traced verify forward per target and settings (as ``_steps``).
_verifies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _verify_for(
    target: Any, fuse_proj: bool, mm: bool, rows: bool, record: str, capture: tuple[int, ...]
) -> tuple[list[tuple], Any]:
    """``(parts, compiled verify forward)`` of ``target`` for these settings (see
    :class:`CompiledVerify`)."""
    per = _verifies.setdefault(target, {})
    key = (fuse_proj, mm, rows, record, capture, *_traced_settings())
    hit = per.get(key)
    if hit is not None:
        return hit
    parts = _parts(target, fuse_proj, mm, rows)
    want = {lid: k for k, lid in enumerate(capture)}
    ref = weakref.ref(target)

    def forward(tokens: mx.array, offset: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        # arrays: two per layer, as the decode step's. Returns the logits, the captured
        # features (when asked), then per Gated-DeltaNet layer its record (conv window, gate
        # inputs a and b, states) and conv state after the block, per attention layer its
        # key and value buffers.
        # offset: the position of the block's first token, a scalar (one sequence) or one per
        # batch row (N,) (slot caches), as the layer path's attention runners pass it.
        t = ref()
        T = tokens.shape[1]
        h = t.embed(tokens)
        first = offset.reshape(-1)  # (1,) or (N,)
        at = first.reshape(-1, 1, 1, 1) + mx.arange(T, dtype=mx.int32).reshape(1, 1, T, 1)
        captured: list[mx.array | None] = [None] * len(capture)
        out: list[mx.array] = []
        for i, part in enumerate(parts):
            a, b = arrays[2 * i], arrays[2 * i + 1]
            if part[0] == "gdn":
                h, rec = _gdn_layer(part, h, a, b, record, mm)
                out += [rec.conv_input, rec.a, rec.b, rec.rec, mx.contiguous(rec.final_conv_state)]
            else:
                pieces = part[1]
                q, k, v, gate = pieces.pre(h, offset)
                a = mx.put_along_axis(a, at, k, axis=2)
                b = mx.put_along_axis(b, at, v, axis=2)
                if rows and cuda_attention.supported(q, a, b) is None:
                    o = pieces.attend_rows(q, a, b, first, gate)
                    h = pieces.post_rows(h, o, gate)
                else:  # the buffer whole, each row's later positions masked out
                    valid = mx.arange(a.shape[2]).reshape(1, 1, 1, -1) <= at  # (1 or N, 1, T, K)
                    o = mx.fast.scaled_dot_product_attention(
                        q, a, b, scale=pieces.scale, mask=valid
                    )
                    h = pieces.post(h, o, gate)
                out += [a, b]
            if i in want:
                captured[want[i]] = h
        feats = [mx.concatenate(captured, axis=-1)] if capture else []
        return (t.logits(h, mm), *feats, *out)

    hit = per[key] = (parts, mx.compile(forward))
    return hit


class CompiledVerify:
    """A DFlash verify forward (a block of T tokens for one sequence, or for each row of a slot
    cache) of ``target`` as one compiled graph, recording for the rollback what
    :func:`hf2q.runtime.verify.verify_forward` records through the layer runners.

    Args:
        target: a :class:`hf2q.runtime.target.TargetModel` of a Qwen3.5 model.
        fuse_proj, mm, rows: as :class:`CompiledDecode`'s.
        capture: the layers whose outputs are the drafter's target features.

    What the Gated-DeltaNet layers keep (per-step states, or the final state for a replay) is
    picked per call as the layer path picks it (``select.gdn_record`` of the block's per-step
    record size, which grows with the rows); each kind is its own graph.
        block: the block length its caller runs it for (:func:`hf2q.runtime.verify.whole_verify`).
    """

    def __init__(
        self,
        target: Any,
        *,
        fuse_proj: bool = False,
        mm: bool = False,
        rows: bool = False,
        capture: Sequence[int] = (),
        block: int = 0,
    ):
        self.block = int(block)
        self.capture = tuple(int(i) for i in capture)
        self._step_bytes = int(target.gdn_state_size) * 4  # a layer's float32 state, one row
        self._make = functools.partial(_verify_for, target, fuse_proj, mm, rows)
        self._graphs: dict[str, tuple[list[tuple], Any]] = {}  # record kind -> traced on first use

    def graph(self, record: str) -> tuple[list[tuple], Any]:
        """``(parts, compiled forward)`` recording ``record``."""
        got = self._graphs.get(record)
        if got is None:
            got = self._graphs[record] = self._make(record, self.capture)
        return got

    @staticmethod
    def supports(target: Any, cache: Sequence[Any]) -> bool:
        """Whether every layer and cache is one this forward computes: the decode step's layers,
        Gated-DeltaNet caches that record for the rollback (``GDNRollbackCache``), attention
        caches whose buffer index is the position (mlx-lm's ``KVCache``, hf2q's bucketed and
        slot caches), holding positions already."""
        from hf2q.runtime.cache import BucketedKVCache, GDNRollbackCache
        from hf2q.runtime.slot_cache import SlotKVCache

        return _supported(target, cache, GDNRollbackCache, (KVCache, BucketedKVCache, SlotKVCache))

    exact = staticmethod(CompiledDecode.exact)

    def __call__(self, tokens: mx.array, cache: Any) -> tuple[mx.array, mx.array | None]:
        """``(logits (N, T, vocab), features (N, T, len(capture) * H) or None)`` of ``tokens``
        (N, T); ``cache`` (a ``TargetCache`` or ``SlotTargetCache`` whose ``begin_verify(T)`` was
        called) advanced by T positions, each Gated-DeltaNet layer holding its record for
        ``cache.rollback``."""
        T = tokens.shape[1]
        record = select.gdn_record(tokens.size * self._step_bytes)
        parts, fn = self.graph(record)
        arrays: list[mx.array] = []
        offset = None
        slots = False
        for part, c in zip(parts, cache, strict=True):
            if part[0] == "gdn":
                arrays += [c[0], c[1]]  # the state before the block stays: a replay starts there
                continue
            if isinstance(c.offset, mx.array):  # a slot cache: a position per row
                c.reserve_block(T, graph_capacity)
                if offset is None:  # every layer's rows are at the same positions
                    offset, slots = c.offset, True
            else:
                offset = held_position(c, T, offset)
            arrays += [c.keys, c.values]
            c.keys = c.values = None  # the graph holds the only reference: written in place
        if not slots:
            offset = mx.array(offset or 0, dtype=mx.int32)
        # Each Gated-DeltaNet layer's state before the block (a replay's start); not the KV
        # buffers, whose only reference the graph must hold to write them in place.
        before = [arrays[2 * j + 1] if p[0] == "gdn" else None for j, p in enumerate(parts)]
        res = fn(tokens, offset, *arrays)
        del arrays
        logits = res[0]
        feats = res[1] if self.capture else None
        i = 2 if self.capture else 1
        for part, c, state0 in zip(parts, cache, before, strict=True):
            if part[0] == "gdn":
                conv_input, a, b, rec, conv = res[i : i + 5]
                i += 5
                if record == "final":
                    kept = GdnRecord(conv_input, a, b, state0, rec, "final")
                    replay = RowReplay(part[1].linear_attn, kept, part[2])
                    c.set_record(conv_input, rec, replay=replay, steps=T)
                    c[1] = rec
                else:
                    c.set_record(conv_input, rec)
                    c[1] = rec[:, -1]
                c[0] = conv
                c.advance(T)
            else:
                c.keys, c.values = res[i], res[i + 1]
                i += 2
                if slots:
                    c.written(T)
                else:
                    c.offset += T
        return logits, feats
