"""A Qwen3.5 full-attention decoder layer in three compiled pieces around mlx-lm's KV cache.

What it does: split mlx-lm's ``DecoderLayer`` (``Qwen3NextAttention`` + MLP) at the only
stateful step, the KV-cache update, so the rest can run under ``mx.compile``:

1. ``pre`` (compiled): input norm, q/k/v projections (optionally one concatenated matmul), q/k
   norms and rotary embedding at the cache offset (passed as an array, so one trace serves every
   position);
2. mlx-lm's own ``cache.update_and_fetch`` and ``scaled_dot_product_attention`` (not compiled),
   or with ``rows`` (CUDA, bf16/fp16) hf2q's row-invariant kernel
   (:mod:`hf2q.kernels.cuda_attention`) reading the cache buffer in place, for caches whose
   buffer index is the position (:func:`reads_buffer_in_place`);
3. ``post`` (compiled): output gate, ``o_proj``, residual, norm, MLP, residual.

This fuses the elementwise work and removes most of the Python overhead of a decode step. The
math is mlx-lm's (``tests/test_kernels_attention.py`` checks the result against mlx-lm's own
layer on every change of either).

What it does not do: support quantized KV caches or attention sinks (use the layer's own call).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from hf2q.kernels import cuda_attention, cuda_norm, select
from hf2q.kernels.gdn import _alive, concat_linears, mlp_fused
from hf2q.kernels.linear import linear, linears, normed, swiglu_mlp

AttentionRunner = Callable[[mx.array, Any, Any], mx.array]


def positions(first: int | mx.array) -> mx.array:
    """A cache offset as the int32 array compiled pieces take: an int becomes a constant; a slot
    cache's (B,) int32 offsets are passed as they are (``mx.array(a, dtype=...)`` of an array is
    an ``AsType`` node, a copy kernel on a GPU, for every layer of every step)."""
    if isinstance(first, mx.array):
        return first if first.dtype == mx.int32 else first.astype(mx.int32)
    return mx.array(first, dtype=mx.int32)


def reads_buffer_in_place(cache: Any) -> bool:
    """Whether the row-invariant kernel may attend over ``cache.keys`` / ``cache.values`` whole:
    mlx-lm's plain ``KVCache`` and caches declaring ``positions_are_indices`` (hf2q's bucketed
    and slot caches), where batch row b's key of position p sits at buffer index p and the
    row's offset is the position of its next key. Other caches (rotating, quantized, left-padded
    batches) keep MLX's attention with their own masks."""
    return type(cache) is KVCache or getattr(type(cache), "positions_are_indices", False)


class AttentionPieces(NamedTuple):
    """The uncompiled math of a Qwen3.5 full-attention decoder layer around its KV cache."""

    pre: Callable  # (x, offset array) -> (queries, keys, values, gate), rotated at offset
    post: Callable  # (x, attention (B, heads, L, d), gate) -> layer output
    post_rows: Callable  # (x, attention (B, L, heads, d), gate) -> layer output
    scale: float
    #: ``gate_in_kernel``: the ``gate`` of ``pre`` is the q projection's output (B, L, heads *
    #: 2 d), which :meth:`attend_rows` hands the attention launch to apply (``post_rows`` then
    #: takes the gated attention); ``post`` takes the gate out of it itself.
    gate_layout: tuple[int, int] | None = None

    def attend_rows(
        self, q: mx.array, keys: mx.array, values: mx.array, first: Any, gate: mx.array
    ) -> mx.array:
        """The row-invariant attention (B, L, heads, d) that ``post_rows`` takes: gated in the
        launch where the pieces were built so (:attr:`gate_layout`)."""
        if self.gate_layout is None:
            return cuda_attention.row_attention_cuda(q, keys, values, first, self.scale)
        return cuda_attention.row_attention_cuda(
            q, keys, values, first, self.scale, gate=gate, gate_layout=self.gate_layout
        )


def _norm_rope_takes(
    sa: nn.Module, q_out: mx.array, keys: mx.array, nq: int, nkv: int, head_dim: int
) -> bool:
    """Whether :func:`hf2q.kernels.cuda_norm.norm_rope_cuda` takes this layer's queries (from
    the q projection's output, each head's queries before its gate) and keys."""
    return (
        cuda_norm.norm_rope_supported(q_out, sa.q_norm, sa.rope, nq, 2 * head_dim) is None
        and cuda_norm.norm_rope_supported(keys, sa.k_norm, sa.rope, nkv, head_dim) is None
    )


def attention_pieces(
    layer: nn.Module,
    *,
    fuse_proj: bool = False,
    mm: bool = False,
    rows: bool = False,
) -> AttentionPieces:
    """The pieces :func:`compile_attention_layer` compiles (and a whole compiled forward traces).

    Args:
        layer: mlx-lm's Qwen3.5 full-attention ``DecoderLayer`` (``layer.self_attn``).
        fuse_proj: compute q/k/v with one matmul and the MLP's gate/up with one (weights are
            concatenated once, here; the layer itself is not changed).
        mm: products through :func:`hf2q.kernels.linear.linear` (the small-M kernel on CUDA).
        rows: the pieces serve the row-invariant attention kernel's path, where
            ``select.attn_gate_enabled()`` puts the output gate in that launch (see
            :attr:`AttentionPieces.gate_layout`) and ``select.norm_rope_enabled()`` computes the
            query and key norms with their RoPE in one launch each where it takes them.
    """
    gate_in_kernel = rows and select.attn_gate_enabled()
    norm_rope = rows and select.norm_rope_enabled()
    ref = weakref.ref(layer)  # the model owns the layer; these functions must not keep it alive
    sa = layer.self_attn
    nq, nkv, head_dim, scale = sa.num_attention_heads, sa.num_key_value_heads, sa.head_dim, sa.scale
    qkv = concat_linears([sa.q_proj, sa.k_proj, sa.v_proj]) if fuse_proj else None
    gate_up = concat_linears([layer.mlp.gate_proj, layer.mlp.up_proj]) if fuse_proj else None
    q_width = nq * head_dim * 2
    kv_width = nkv * head_dim
    del sa

    def pre(x: mx.array, offset: mx.array):
        lay = _alive(ref)
        sa = lay.self_attn
        B, L, _ = x.shape
        h = normed(lay.input_layernorm, x, mm)  # (in the products' launch where it can)
        if qkv is None:
            q_out, keys, values = linears([sa.q_proj, sa.k_proj, sa.v_proj], h, mm)
        else:
            q_out, keys, values = mx.split(
                linear(qkv, h, mm), [q_width, q_width + kv_width], axis=-1
            )
        queries, gate = mx.split(q_out.reshape(B, L, nq, -1), 2, axis=-1)
        # In the kernel, the gate is read from the projection in place: no copy of its half.
        gate = q_out if gate_in_kernel else gate.reshape(B, L, -1)
        if norm_rope and _norm_rope_takes(sa, q_out, keys, nq, nkv, head_dim):
            # each norm and its RoPE in one launch (the same bits), from the projections as
            # they are: no copies out of the strided queries, before the rotation, after it
            values = values.reshape(B, L, nkv, -1).transpose(0, 2, 1, 3)
            return (
                cuda_norm.norm_rope_cuda(q_out, sa.q_norm, sa.rope, nq, 2 * head_dim, offset),
                cuda_norm.norm_rope_cuda(keys, sa.k_norm, sa.rope, nkv, head_dim, offset),
                values,
                gate,
            )
        queries = sa.q_norm(queries).transpose(0, 2, 1, 3)
        keys = sa.k_norm(keys.reshape(B, L, nkv, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, nkv, -1).transpose(0, 2, 1, 3)
        return sa.rope(queries, offset=offset), sa.rope(keys, offset=offset), values, gate

    def finish(x: mx.array, o: mx.array) -> mx.array:
        # o: (B, L, heads * d) gated attention output in row order.
        lay = _alive(ref)
        h = linear(lay.self_attn.o_proj, o, mm, add=x)
        hn = normed(lay.post_attention_layernorm, h, mm)
        if gate_up is None:
            return swiglu_mlp(lay.mlp, hn, mm, add=h)
        return mlp_fused(lay.mlp, gate_up, hn, mm, add=h)

    def post_rows(x: mx.array, o: mx.array, gate: mx.array) -> mx.array:
        # o: (B, L, heads, d) attention output in row order (gated already: gate_in_kernel).
        B, L, _ = x.shape
        if gate_in_kernel:
            return finish(x, o.reshape(B, L, -1))
        return finish(x, o.reshape(B, L, -1) * mx.sigmoid(gate))

    def post(x: mx.array, attn: mx.array, gate: mx.array) -> mx.array:
        # attn: (B, heads, L, d) as MLX's attention returns it (never gated).
        B, L, _ = x.shape
        if gate_in_kernel:  # the projection's output: its gate half, as pre cuts it otherwise
            gate = mx.split(gate.reshape(B, L, nq, -1), 2, axis=-1)[1].reshape(B, L, -1)
        return finish(x, attn.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate))

    layout = (2 * head_dim, head_dim) if gate_in_kernel else None
    return AttentionPieces(pre, post, post_rows, scale, layout)


def compile_attention_layer(
    layer: nn.Module, *, fuse_proj: bool = False, mm: bool = False, rows: bool = False
) -> AttentionRunner:
    """A function ``(x, mask, cache) -> out`` equal to ``layer(x, mask, cache)``, mostly compiled.

    Args:
        layer: mlx-lm's Qwen3.5 full-attention ``DecoderLayer`` (``layer.self_attn``).
        fuse_proj, mm: as in :func:`attention_pieces`.
        rows: attend with :func:`hf2q.kernels.cuda_attention.row_attention_cuda` where it
            applies (CUDA, bf16/fp16, :func:`reads_buffer_in_place` caches): each query row's
            bits are then independent of how many rows a call computes. The mask argument is
            not needed there (causal by position).
    """
    ref = weakref.ref(layer)
    pieces = attention_pieces(layer, fuse_proj=fuse_proj, mm=mm, rows=rows)
    scale = pieces.scale
    cpre, cpost = mx.compile(pieces.pre), mx.compile(pieces.post)
    cpost_rows = mx.compile(pieces.post_rows)

    def run(x: mx.array, mask: Any, cache: Any) -> mx.array:
        if cache is None or hasattr(cache, "bits"):
            return _alive(ref)(x, mask=mask, cache=cache)
        first = cache.offset  # positions before the new rows: int, or (B,) per slot row
        queries, keys, values, gate = cpre(x, positions(first))
        if (
            rows
            and reads_buffer_in_place(cache)
            and cuda_attention.supported(queries, keys, values) is None
        ):
            cache.update_and_fetch(keys, values)
            out = pieces.attend_rows(queries, cache.keys, cache.values, first, gate)
            return cpost_rows(x, out, gate)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=scale, mask=mask
        )
        return cpost(x, out, gate)

    return run
