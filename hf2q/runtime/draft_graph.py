"""The drafter's forward of a full block as one ``mx.compile`` graph (``HF2Q_COMPILE_DRAFT``).

Why: a DFlash round on a GPU waits for the host. The target's verify and the plain step already
run as one compiled graph each (:mod:`hf2q.kernels.forward`); the drafter's forward was still
built layer by layer on the host: per layer a compiled projection piece, the cache writes, the
attention kernel, the dropping of the block's entries and a compiled output piece, each a call
from Python, then the context projection, the final norm and the target's head. One compiled
graph for the whole forward is replayed from C++ instead.

What it does: :class:`CompiledDraft` runs a block of ``block_size`` tokens for one sequence
(mlx-lm's ``KVCache`` per layer) or for every row of a slot cache
(:class:`hf2q.runtime.slot_cache.SlotKVCache`, a position and a kept context count per row):
the target features through ``fc`` and ``hidden_norm``, every layer, the final norm and the
target's head, in one function. The new context rows are padded to the block length (zeros; a
row keeps its own count), so one trace serves every round whatever was accepted; the context a
run of lookup rounds leaves the drafter (more than a block) is padded to a multiple of it, up to
:data:`MAX_CONTEXT_BLOCKS` blocks, a trace each. Each layer takes its context and block rows in
the order of their positions (a row's kept context rows, its block right after them, its
padding rows past the block's end: one gather), computes their keys and values (one grouped
launch on CUDA), rotates them from the row's offset in one RoPE call and writes them into the
cache buffers by one scatter each; the block attends over the buffers in place: the
row-invariant CUDA kernel where the layer path's fast layers use it, else MLX's attention over
the whole buffer with a mask. Nothing reads a position past the block's end, and the next
round writes every position it reads before reading it. The caches keep the verified context
only, as the layer path leaves them: each row's offset moves by its kept count.

Same values as the layer path: the layers' math is the same pieces in the same order; products
are computed over more rows (the padding), which changes no bit where the products are
row-invariant (hf2q's small-M kernel on CUDA) and may round otherwise. Drafts only propose:
whatever their bits, DFlash's output is the target's (greedy tokens equal plain decoding's).

What it does not do: blocks shorter than the generation's block size (its last), more new
context rows than :data:`MAX_CONTEXT_BLOCKS` blocks, caches holding nothing yet, or any other
cache type: :meth:`hf2q.runtime.drafter.DFlashDraftModel.__call__` keeps the layer path there.
Training never runs it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from hf2q.kernels import cuda_attention, cuda_norm, select
from hf2q.kernels.forward import graph_capacity, held_position
from hf2q.kernels.linear import (
    FROZEN,
    Frozen,
    joined_linears,
    linear,
    linears,
    normed,
    swiglu_mlp,
    value,
)
from hf2q.runtime.slot_cache import SlotKVCache

#: The most new context rows a graph takes, in blocks (padded to a multiple of the block, a trace
#: each): a run of lookup rounds leaves the drafter their rows to catch up on.
MAX_CONTEXT_BLOCKS = 4

#: The drafter attribute holding its traced forwards, by settings.
_KEPT = "_hf2q_draft_graphs"


def _drafter_weights(drafter: Any) -> list[mx.array]:
    """Every array a trace of ``drafter`` holds as a constant (a trace is rebuilt when one of
    them was replaced: new weights loaded, a dtype change)."""
    from hf2q.runtime.drafter import _layer_weights

    out = [drafter.fc.weight, drafter.hidden_norm.weight, drafter.norm.weight]
    for layer in drafter.layers:
        out += _layer_weights(layer)
    return out


def _positions(off: mx.array, count: mx.array, P: int, L: int) -> tuple[mx.array, mx.array]:
    """``(order, at)``, what every layer writes by: ``order`` (R, P+L) picks, from a layer's
    context rows then block rows, the rows in the order of their positions (each row's kept
    context rows, then its block, then its padding rows, which go past the block's end); ``at``
    (R, 1, P+L, 1) are those positions, ``off`` onwards. The layers share them."""
    s = mx.arange(P + L, dtype=mx.int32).reshape(1, -1)
    n = count.reshape(-1, 1)
    order = mx.where(s < n, s, mx.where(s < n + L, P + s - n, s - L))
    at = off.reshape(-1, 1, 1, 1) + s.reshape(1, 1, -1, 1)
    return order, at


def _joined_positions(off: mx.array, count: mx.array, P: int, L: int) -> mx.array:
    """The position (R, P+L) of each of a layer's context rows then block rows as they come
    (no gather): a row's kept context rows from ``off``, its block right after them, its padding
    rows past the block's end; the places :func:`_positions`' order gives the same rows."""
    s = mx.arange(P + L, dtype=mx.int32).reshape(1, -1)
    n = count.reshape(-1, 1)
    return off.reshape(-1, 1) + mx.where(s < P, mx.where(s < n, s, s + L), n + s - P)


def _visible(a: Any, first: mx.array, L: int, C: int) -> mx.array:
    """MLX attention's mask (R, 1, L, C) over a whole buffer of C positions: each block row sees
    its row's keys up to the block's end (and, causal, up to itself; within the window)."""
    kpos = mx.arange(C, dtype=mx.int32).reshape(1, 1, 1, -1)
    qpos = first.reshape(-1, 1, 1, 1) + mx.arange(L, dtype=mx.int32).reshape(1, 1, L, 1)
    vis = kpos < first.reshape(-1, 1, 1, 1) + L
    if a.is_causal:
        vis = vis & (kpos <= qpos)
    if a.sliding_window is not None:
        vis = vis & (qpos - kpos < a.sliding_window)
    return vis


def _layer(lay: Any, x: mx.array, ctx: mx.array, where: tuple, K, V, mm, rows: bool, masks: dict):
    """One drafter layer of the graph over block rows ``x`` (R, L, H) and padded new context
    rows ``ctx`` (R, P, H): ``(out, K, V)`` with the layer's buffers written. ``where``: the
    rows' offsets, the block's first positions, then :func:`_positions` and None, or (with the
    norm + RoPE launch) None, None and :func:`_joined_positions`; ``masks``: MLX attention's
    masks made so far, by kind of layer."""
    a = lay.self_attn
    R, L, _ = x.shape
    off, first, order, at, joined = where
    h = normed(lay.input_layernorm, x, mm)  # (in the products' launches where it can)
    D = a.head_dim
    if joined is not None:
        # Context and block rows as they come, through the k and v products (one grouped launch
        # on CUDA; rows are independent; with HF2Q_NORM_MM the block rows normed in it and no
        # copy joining them), each norm and its RoPE in one launch (the same bits) at each
        # row's own position, written there by one scatter each: the same buffers as the rows
        # put in order below (no gather).
        k, v = joined_linears([a.k_proj, a.v_proj], ctx, h, mm)
        k = cuda_norm.norm_rope_cuda(k, a.k_norm, a.rope, a.n_kv_heads, D, joined)
        q = cuda_norm.norm_rope_cuda(linear(a.q_proj, h, mm), a.q_norm, a.rope, a.n_heads, D, first)
        at = joined.reshape(R, 1, -1, 1)
    else:
        # Context and block rows in the order of their positions (a gather), through the k and
        # v products, rotated from the row's offset, written by one scatter each: contiguous
        # positions per row, the padding's past the block's end.
        h = value(h)
        rows_in_order = mx.take_along_axis(
            mx.concatenate([ctx, h], axis=1), order[..., None], axis=1
        )
        k, v = linears([a.k_proj, a.v_proj], rows_in_order, mm)  # one launch where grouped
        k = a.rope(a.k_norm(a._heads(k, a.n_kv_heads)), offset=off)
        q = a.queries(h, first, mm)
    K = mx.put_along_axis(K, at, k, axis=2)
    V = mx.put_along_axis(V, at, a._heads(v, a.n_kv_heads), axis=2)
    if rows and cuda_attention.supported(q, K, V) is None:
        o = cuda_attention.row_attention_cuda(
            q, K, V, first, a.scale, window=a.sliding_window, causal=a.is_causal
        )  # (R, L, heads, d)
    else:  # the buffer whole, masked
        kind = (a.is_causal, a.sliding_window, K.shape[2])
        if kind not in masks:
            masks[kind] = _visible(a, first, L, K.shape[2])
        o = mx.fast.scaled_dot_product_attention(q, K, V, scale=a.scale, mask=masks[kind])
        o = o.transpose(0, 2, 1, 3)
    h = linear(a.o_proj, o.reshape(R, L, -1), mm, add=x)
    return swiglu_mlp(lay.mlp, normed(lay.post_attention_layernorm, h, mm), mm, add=h), K, V


def _callable_key(fn: Any) -> Any:
    """A hashable key of a bound head (a bound method's owner may be an unhashable module; a
    target's ``head`` method is a new object at each access, equal to the last): its owner's id
    and function, or a plain function's id. The kept entry's ``==`` check guards a reused id."""
    owner, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    return (id(owner), func) if owner is not None and func is not None else id(fn)


def _graph_for(drafter: Any, mm: bool, head_mm: Frozen | None, rows: bool) -> Any:
    """The compiled forward of ``drafter`` for these settings (see :class:`CompiledDraft`), kept
    on the drafter as a plain attribute (not a parameter; it goes with the drafter), so a later
    generation replays its traces."""
    per = drafter.__dict__.get(_KEPT)
    if per is None:
        per = {}
        object.__setattr__(drafter, _KEPT, per)
    key = (
        mm,
        head_mm,
        rows,
        select.mm_key(),
        select.kernel_mode(),
        select.backend(),
        select.compile_enabled(),
        select.trace_key(),
        _callable_key(drafter._head),
    )
    weights = _drafter_weights(drafter)
    hit = per.get(key)
    if (
        hit is not None
        and hit[1] == drafter._head
        and hit[2] is drafter._embed
        and len(hit[0]) == len(weights)
        and all(a is b for a, b in zip(hit[0], weights))
    ):
        return hit[3]
    ref = weakref.ref(drafter)  # the kept trace must not keep its drafter alive
    on = mm or FROZEN  # inference: products off the kernel read kept transposed views
    dtype = drafter.layers[0].input_layernorm.weight.dtype if drafter.layers else None
    norm_rope = select.norm_rope_enabled() and all(
        cuda_norm.norm_rope_takes(dtype, lay.self_attn.k_norm, lay.self_attn.rope) is None
        and cuda_norm.norm_rope_takes(dtype, lay.self_attn.q_norm, lay.self_attn.rope) is None
        for lay in drafter.layers
    )

    def forward(
        block: mx.array, features: mx.array, off: mx.array, count: mx.array, *arrays: mx.array
    ) -> tuple[mx.array, ...]:
        # block (R, L) token ids; features (R, P, n_ids*H) new context, padded; off (R,) each
        # row's position (its context's first); count (R,) the context rows each row keeps;
        # arrays: (keys, values) buffers per layer, returned written after the logits.
        d = ref()
        x = d._embed(block)
        ctx = d.context(features, on)
        first = off + count
        P, L = ctx.shape[1], block.shape[1]
        if norm_rope:  # every layer's q/k norms and RoPE in one launch each, rows as they come
            where = (off, first, None, None, _joined_positions(off, count, P, L))
        else:
            where = (off, first, *_positions(off, count, P, L), None)
        masks: dict = {}
        out: list[mx.array] = []
        for i, lay in enumerate(d.layers):
            K, V = arrays[2 * i], arrays[2 * i + 1]
            x, K, V = _layer(lay, x, ctx, where, K, V, on, rows, masks)
            out += [K, V]
        h = d.norm(x)[:, 1:]
        logits = d._head(h) if head_mm is None else d._head(h, mm=head_mm)
        return (logits, *out)

    fn = mx.compile(forward)
    per[key] = (weights, drafter._head, drafter._embed, fn)
    return fn


class CompiledDraft:
    """One generation's drafter forwards of full blocks (see the module docstring) as one
    compiled graph (:meth:`hf2q.runtime.drafter.DFlashDraftModel.graph` makes it).

    Args:
        drafter: a bound :class:`hf2q.runtime.drafter.DFlashDraftModel`.
        block: the generation's block length; shorter blocks keep the layer path (:meth:`takes`).

    The settings a trace depends on are read when a row count is first drafted: whether the
    products run the small-M kernel (``drafter.kernel_products``, by the block's rows, and for
    the head), and whether attention is the row-invariant kernel (``select.row_attention_enabled``);
    traces are kept on the drafter by those settings and its weights (a later generation
    replays them; new weights trace again).
    """

    def __init__(self, drafter: Any, block: int) -> None:
        self.block = int(block)
        self._drafter = drafter
        self._fns: dict[int, Any] = {}  # block rows (R x L) -> the compiled forward

    def takes(self, block: mx.array, features: mx.array, cache: Sequence[Any]) -> bool:
        """Whether this graph drafts ``block`` (R, L) after new context ``features`` (R, S, F):
        a full block, 1 row to :data:`MAX_CONTEXT_BLOCKS` blocks of new rows, every layer's cache
        mlx-lm's ``KVCache`` (exactly) or hf2q's slot cache, holding positions already (a prompt
        was added)."""
        L, S = block.shape[1], features.shape[1]
        return (
            self.block == L
            and 0 < S <= MAX_CONTEXT_BLOCKS * L
            and all(
                (type(c) is KVCache or isinstance(c, SlotKVCache)) and c.keys is not None
                for c in cache
            )
        )

    def _fn(self, rows: int) -> Any:
        fn = self._fns.get(rows)
        if fn is None:
            d = self._drafter
            attn = select.row_attention_enabled()
            fn = self._fns[rows] = _graph_for(d, d.kernel_products(rows), d.head_mm(rows), attn)
        return fn

    def __call__(self, block: mx.array, features: mx.array, cache: Sequence[Any]) -> mx.array:
        """Draft logits (R, L-1, vocab) of ``block`` (R, L) after each row appends its new context
        ``features`` (R, S, n_ids*H), where :meth:`takes` it: all S rows for one sequence, each
        row's prepared count for a slot cache (``prepare(lengths=...)``, as before a layer-path
        call). The caches advance by those counts."""
        R, L = block.shape
        S = features.shape[1]
        P = -(-S // L) * L  # the new context rows, padded: one trace whatever was accepted
        if S < P:
            features = mx.pad(features, [(0, 0), (0, P - S), (0, 0)])
        arrays: list[mx.array] = []
        off = count = None
        held: int | None = None
        for c in cache:
            if isinstance(c, SlotKVCache):
                c.reserve_block(P + L, graph_capacity)
                if off is None:  # the layers hold the same positions and counts
                    off, count = c.offset, c.prepared(S)
            else:
                held = held_position(c, P + L, held)
            arrays += [c.keys, c.values]
            c.keys = c.values = None  # the graph holds the only reference: written in place
        if off is None:  # one sequence: every layer at ``held``, keeping all S rows
            off = mx.array([held], dtype=mx.int32)
            count = mx.array([S], dtype=mx.int32)
        res = self._fn(R * L)(block, features, off, count, *arrays)
        del arrays
        for i, c in enumerate(cache):
            c.keys, c.values = res[1 + 2 * i], res[2 + 2 * i]
            if isinstance(c, SlotKVCache):
                c.written(S)
            else:
                c.offset += S
        return res[0]


__all__ = ["CompiledDraft"]
