"""Linear layers of hf2q's decoding paths through the small-M tensor-core kernel on CUDA.

What it does: :func:`linear` computes ``mod(x)`` for one ``nn.Linear`` (and :func:`head` the
tied-embedding head ``x @ embedding.T``); when ``on`` (``select.small_mm_enabled()``, resolved
once by the caller) and the product fits (:func:`fits`) it runs
:func:`hf2q.kernels.cuda_matmul.small_matmul_cuda`: one graph node where MLX's ``nn.Linear`` makes
four (transpose, flatten, matmul, unflatten) and, for more than one row, a cuBLASLt call whose
set-up and stream capture cost the host about 8 us more per product on an H200
(``benchmarks/node_cost.py``). :func:`swiglu_mlp` is mlx-lm's SwiGLU MLP through :func:`linear`.

Only hf2q's own paths call these (compiled layer runners, verify, drafter inference, the
target's head); mlx-lm's modules are never changed, so a stock mlx-lm baseline stays stock.

Quantized layers (MLX's affine 4- and 8-bit ``nn.QuantizedLinear``, a tied
``nn.QuantizedEmbedding`` head) run the kernel's dequantizing variant
(:func:`hf2q.kernels.cuda_matmul.small_qmatmul_cuda`) where ``select.small_qmm_enabled()``, up to
the same row counts: MLX's quantized product computes a row differently at different row counts,
which in bf16 lets a verify row part from its decode step.

What it does not do: other quantization modes, float32, training (the kernel has no gradient:
training never passes ``on``), or products with many rows of a large weight (cuBLAS is faster
there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from hf2q.kernels import cuda_matmul


@dataclass(frozen=True)
class Frozen:
    """The ``on`` argument of an inference path whose weights never change while it runs (the
    drafter's compiled layers): products stay on MLX's matmul as with ``on=False`` (it is
    falsy), but each reads its weight through a transposed view made and evaluated once
    (:func:`transposed`) instead of transposing the weight in every forward: the same strides
    and the same matmul, so the same bits, one graph node less a product. Never for training
    (the view carries no gradient)."""

    def __bool__(self) -> bool:
        return False


#: The one :class:`Frozen` value.
FROZEN = Frozen()


def kept(owner: nn.Module, name: str, sources: list[mx.array], build: Callable[[], Any]) -> Any:
    """``build()``'s result kept on ``owner`` as a plain attribute (not a parameter: saving and
    training never see it), rebuilt whenever any of the ``sources`` arrays it was built from was
    replaced (new weights loaded, a dtype change)."""
    hit = owner.__dict__.get(name)
    if (
        hit is None
        or len(hit[0]) != len(sources)
        or any(a is not b for a, b in zip(hit[0], sources))
    ):
        hit = (sources, build())
        object.__setattr__(owner, name, hit)
    return hit[1]


def kept_view(mod: nn.Module, name: str, make: Callable[[mx.array], mx.array]) -> mx.array:
    """``make(mod.weight)`` evaluated once (a view of the weight such as a transpose or a
    reshape: no copy) and :func:`kept` on ``mod``. What inference graphs read instead of
    deriving the view in every forward: one graph node less each time, the same values."""

    def build() -> mx.array:
        view = make(mod.weight)
        mx.eval(view)
        return view

    return kept(mod, name, [mod.weight], build)


def transposed(mod: nn.Linear | nn.Embedding) -> mx.array:
    """``mod.weight.T`` as :func:`kept_view` keeps it (a strided view of the weight)."""
    return kept_view(mod, "_hf2q_transposed", lambda w: w.T)


def _matmul(mod: nn.Module, x: mx.array, on: bool | Frozen) -> mx.array:
    """``mod(x)`` off the kernel: through :func:`transposed` for a plain ``nn.Linear`` when
    ``on`` is :data:`FROZEN` (bias added as ``nn.Linear`` adds it); a quantized layer's product
    of all rows at once then (:func:`_flat_rows`)."""
    if isinstance(on, Frozen) and type(mod) is nn.Linear:
        if "bias" in mod:
            return mx.addmm(mod.bias, x, transposed(mod))
        return x @ transposed(mod)
    if isinstance(on, Frozen) and type(mod) is nn.QuantizedLinear:
        return _flat_rows(mod, x)
    return mod(x)


def _flat_rows(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """``fn(x)`` of a quantized product with ``x``'s leading dimensions joined into one row
    dimension. MLX's CUDA quantized product takes a (slots, rows, K) input as a batched GEMM of
    ``slots`` products of ``rows`` rows (its qmm source: M = the last-but-one dimension, the rest
    a batch), each a pass over the weight: session 49's four-slot round of the 4B-shaped pair
    went 8.83 -> 9.47 ms with an 8-bit draft head so. Drafts only (:data:`FROZEN`): rows need
    not keep the bits they have at other row counts there."""
    if x.ndim <= 2:
        return fn(x)
    y = fn(x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


#: Rows sent to the kernel whatever the weight's size, unless ``HF2Q_SMALL_MM_ROWS`` says fewer:
#: all it takes (``cuda_matmul.MAX_ROWS``, eight slots of a 16-token verify), so that every verify
#: row is computed as a decode step computes it (the kernel's rows do not depend on their count;
#: cuBLAS rounds differently, and in bf16 greedy DFlash could then part from plain decoding).
ALWAYS_ROWS = cuda_matmul.MAX_ROWS
#: Weights up to this many elements go to the kernel up to ``cuda_matmul.MAX_ROWS`` rows.
SMALL_WEIGHT = 1 << 22


def fits(x: mx.array, w: mx.array) -> bool:
    """Whether the kernel computes ``x @ w.T`` (dtypes, shapes, rows; see module doc): up to
    ``select.small_mm_rows()`` rows (``HF2Q_SMALL_MM_ROWS``, default :data:`ALWAYS_ROWS`) always,
    up to the kernel's most for small weights."""
    return cuda_matmul.supported(x, w) is None and _rows_fit(x, w)


def _rows_fit(x: mx.array, w: mx.array) -> bool:
    """The rows rule of :func:`fits` for a product the kernel supports."""
    return _rows_count_fit(x.size // x.shape[-1], w)


def _rows_count_fit(rows: int, w: mx.array) -> bool:
    """:func:`_rows_fit` for ``rows`` rows."""
    return w.size <= SMALL_WEIGHT or rows <= _select().small_mm_rows()


def _select():
    from hf2q.kernels import select  # select imports this module

    return select


def _grouping() -> bool:
    return _select().grouped_mm_enabled()


def _columns() -> bool:
    return _select().mm_columns_enabled()


def _qweights(mod: nn.Module) -> tuple[mx.array, mx.array, mx.array, int]:
    """A quantized module's (packed weight, scales, biases, N) as the dequantizing kernel reads
    them: with N not a multiple of 8 (a Gated-DeltaNet layer's 4-wide gate projections of a
    small model) zero rows are appended once and kept on the module (:func:`kept`), and the
    caller keeps the first N columns of the product."""
    w, scales, biases = mod.weight, mod.scales, mod["biases"]
    N = w.shape[0]
    if N % 8 == 0:
        return w, scales, biases, N

    def build() -> tuple[mx.array, mx.array, mx.array]:
        pad = [(0, -N % 8), (0, 0)]
        out = (mx.pad(w, pad), mx.pad(scales, pad), mx.pad(biases, pad))
        mx.eval(out)
        return out

    return (*kept(mod, "_hf2q_qpadded", [w, scales, biases], build), N)


QWeights = tuple[mx.array, mx.array, mx.array, int]


def _quantized(mod: nn.Module, x: mx.array) -> QWeights | None:
    """``mod``'s weights as the dequantizing kernel reads them (:func:`_qweights`) when the
    kernel computes its product of ``x`` (an affine-quantized ``nn.QuantizedLinear`` /
    ``nn.QuantizedEmbedding`` it supports, at the rows :func:`fits` takes, with
    ``select.small_qmm_enabled()``), else None."""
    if type(mod) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or mod.mode != "affine":
        return None
    if mod.get("biases") is None or x.dtype != mod.scales.dtype:
        return None  # (before _qweights: no padded copy for a layer the kernel cannot take)
    qw = _qweights(mod)
    w, scales, biases, _ = qw
    if cuda_matmul.quantized_supported(x, w, scales, biases, mod.bits, mod.group_size) is not None:
        return None
    elements = w.shape[0] * w.shape[1] * 32 // mod.bits
    rows_ok = elements <= SMALL_WEIGHT or x.size // x.shape[-1] <= _select().small_mm_rows()
    return qw if rows_ok and _select().small_qmm_enabled() else None


def quantized_fits(mod: nn.Module, x: mx.array) -> bool:
    """Whether hf2q's dequantizing kernel computes ``mod``'s product of ``x`` where asked (see
    :func:`_quantized`): an affine-quantized layer or embedding it supports, in bf16 or fp16, at
    rows it takes, on CUDA."""
    return _quantized(mod, x) is not None


def _qmatmul(mod: nn.Module, x: mx.array, qw: QWeights, add: mx.array | None = None) -> mx.array:
    """:func:`hf2q.kernels.cuda_matmul.small_qmatmul_cuda` of ``mod``'s weights ``qw`` (from
    :func:`_quantized`; ``+ add`` in the launch, for N a multiple of 8)."""
    w, scales, biases, N = qw
    y = cuda_matmul.small_qmatmul_cuda(
        x, w, scales, biases, bits=mod.bits, group=mod.group_size, add=add
    )
    return y if w.shape[0] == N else y[..., :N]


def _add_in_launch(mod: nn.Module, x: mx.array, add: mx.array | None, N: int) -> bool:
    """Whether a residual ``add`` joins the product's launch: a layer without bias, an addend of
    the output's shape and dtype, ``select.grouped_mm_enabled()``."""
    return (
        add is not None
        and "bias" not in mod
        and add.dtype == x.dtype
        and add.shape == (*x.shape[:-1], N)
        and _grouping()
    )


class Normed:
    """Rows ``x`` that ``norm`` (an ``nn.RMSNorm``) norms before the products reading them:
    :func:`linear`, :func:`linears` and :func:`swiglu_mlp` norm them in the kernel's launch where
    it takes the product (``cuda_matmul``'s ``norm=``: the bits of ``norm(x)`` then the product,
    one graph node less), else compute ``norm(x)`` first (:func:`value`). :func:`normed` makes
    one where that can pay. Its ``shape`` and ``dtype`` are ``x``'s."""

    __slots__ = ("x", "norm")

    def __init__(self, x: mx.array, norm: nn.Module) -> None:
        self.x, self.norm = x, norm

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    @property
    def dtype(self) -> Any:
        return self.x.dtype

    def args(self) -> tuple[mx.array, float]:
        """The launch's ``norm=`` argument: (weight, eps)."""
        return self.norm.weight, self.norm.eps


def normed(norm: nn.Module, x: mx.array, on: bool | Frozen) -> mx.array | Normed:
    """``norm(x)`` for the products of :func:`linear`, :func:`linears` and :func:`swiglu_mlp`:
    a :class:`Normed` (the norm in their launches) when ``on``, ``select.norm_mm_enabled()``,
    ``norm`` is an ``nn.RMSNorm`` the launch takes and ``x`` has at most
    ``select.norm_mm_rows()`` rows; else ``norm(x)``."""
    if (
        on
        and type(norm) is nn.RMSNorm
        and _select().norm_mm_enabled()
        and math.prod(x.shape[:-1]) <= _select().norm_mm_rows()
        and cuda_matmul.norm_supported(x, norm.weight) is None
    ):
        return Normed(x, norm)
    return norm(x)


def value(x: mx.array | Normed) -> mx.array:
    """``x`` itself, or a :class:`Normed`'s rows normed (MLX's norm)."""
    return x.norm(x.x) if isinstance(x, Normed) else x


def linear(
    mod: nn.Module, x: mx.array | Normed, on: bool | Frozen, add: mx.array | None = None
) -> mx.array:
    """``mod(x)`` (``mod(x) + add`` with ``add``); through the kernel when ``on`` and ``mod`` is a
    plain ``nn.Linear`` that fits (its dequantizing variant for a quantized layer it takes).
    With ``add`` (a residual), a layer without bias and ``select.grouped_mm_enabled()``, the
    addition happens in the product's launch, with the bits of the two steps. A
    :class:`Normed` ``x`` is normed in the launch of a plain ``nn.Linear`` without bias or
    ``add`` that fits, else first."""
    if isinstance(x, Normed):
        if (
            on
            and type(mod) is nn.Linear
            and add is None
            and "bias" not in mod
            and fits(x.x, mod.weight)
        ):
            return cuda_matmul.small_matmul_cuda(x.x, mod.weight, norm=x.args())
        x = value(x)
    if on and type(mod) is nn.Linear and fits(x, mod.weight):
        if _add_in_launch(mod, x, add, mod.weight.shape[0]):
            return cuda_matmul.small_matmul_cuda(x, mod.weight, add=add, columns=_columns())
        y = cuda_matmul.small_matmul_cuda(x, mod.weight, columns=_columns())
        y = y + mod.bias if "bias" in mod else y
    elif on and type(mod) is nn.QuantizedLinear and (qw := _quantized(mod, x)) is not None:
        N = mod.weight.shape[0]
        if N % 8 == 0 and _add_in_launch(mod, x, add, N):
            return _qmatmul(mod, x, qw, add=add)
        y = _qmatmul(mod, x, qw)
        y = y + mod.bias if "bias" in mod else y
    else:
        y = _matmul(mod, x, on)
    return y if add is None else y + add


@cache
def _swiglu_types() -> tuple[type, ...]:
    from mlx_lm.models.qwen3 import MLP
    from mlx_lm.models.qwen3_next import Qwen3NextMLP

    return (MLP, Qwen3NextMLP)


def _bare(mods: list[nn.Module]) -> bool:
    """Whether every module is a plain ``nn.Linear`` without bias (what one launch of several
    products takes)."""
    return all(type(m) is nn.Linear and "bias" not in m for m in mods)


def linears(mods: list[nn.Module], x: mx.array | Normed, on: bool | Frozen) -> list[mx.array]:
    """``[mod(x) for mod in mods]``; one launch of the grouped kernel when ``on``, products sharing
    an input are grouped here (``select.grouped_mm_enabled()``) and every module is a plain
    ``nn.Linear`` without bias that fits (same bits as :func:`linear` of each), else :func:`linear`
    of each. Compiled runners read the setting when traced, so their caches key on it. A
    :class:`Normed` ``x`` is normed in the grouped launch, else once before the products."""
    rows = x.x if isinstance(x, Normed) else x
    if on and _bare(mods):
        ws = [m.weight for m in mods]
        if (
            _grouping()
            and cuda_matmul.grouped_supported(rows, ws) is None
            and all(_rows_fit(rows, w) for w in ws)
        ):
            if isinstance(x, Normed):
                return cuda_matmul.grouped_matmul_cuda(x.x, ws, norm=x.args())
            return cuda_matmul.grouped_matmul_cuda(x, ws, columns=_columns())
    if isinstance(x, Normed) and len(mods) > 1:
        x = value(x)  # (one norm for the several launches)
    return [linear(m, x, on) for m in mods]


def joined_linears(
    mods: list[nn.Module], ctx: mx.array, x: mx.array | Normed, on: bool | Frozen
) -> list[mx.array]:
    """``linears(mods, concatenate([ctx, x], axis=1), on)``: with a :class:`Normed` ``x``, one
    launch of the joined kernel where it takes them (the context's rows as they come, x's normed
    in the launch: neither the copy nor the norm is a node), else the concatenation first."""
    if isinstance(x, Normed) and on and _bare(mods) and _grouping():
        ws = [m.weight for m in mods]
        rows = ctx.shape[0] * (ctx.shape[1] + x.shape[1])
        if cuda_matmul.joined_supported(ctx, x.x, ws) is None and all(
            _rows_count_fit(rows, w) for w in ws
        ):
            return cuda_matmul.joined_matmul_cuda(ctx, x.x, ws, norm=x.args())
    return linears(mods, mx.concatenate([ctx, value(x)], axis=1), on)


def swiglu_mlp(
    mlp: nn.Module, x: mx.array | Normed, on: bool | Frozen, add: mx.array | None = None
) -> mx.array:
    """mlx-lm's SwiGLU MLP (``down(silu(gate(x)) * up(x))``) with its products through :func:`linear`
    (``+ add``, a residual, with ``add``); under ``select.mm_swiglu_enabled()`` the gate, up and
    SwiGLU in one launch of the kernel where it takes them (same bits).

    Only mlx-lm's dense Qwen3 / Qwen3-Next MLP classes, whose call is exactly that; anything else
    (the sparse MoE block, other MLPs) runs its own call. A :class:`Normed` ``x`` is normed in
    the gate/up launch where it takes it.
    """
    if not (on or isinstance(on, Frozen)) or type(mlp) not in _swiglu_types():
        x = value(x)
        return mlp(x) if add is None else add + mlp(x)
    from mlx_lm.models.activations import swiglu

    gp, up = mlp.gate_proj, mlp.up_proj
    rows = x.x if isinstance(x, Normed) else x
    if (
        on
        and _bare([gp, up])
        and _select().mm_swiglu_enabled()
        and math.prod(x.shape[:-1]) <= _select().mm_swiglu_rows()
        and cuda_matmul.swiglu_supported(rows, gp.weight, up.weight, _columns()) is None
        and _rows_fit(rows, gp.weight)
    ):  # one launch, the bits of the two steps below
        norm = x.args() if isinstance(x, Normed) else None
        act = cuda_matmul.swiglu_matmul_cuda(rows, gp.weight, up.weight, norm=norm)
        return linear(mlp.down_proj, act, on, add=add)
    gate, up = linears([gp, up], x, on)
    return linear(mlp.down_proj, swiglu(gate, up), on, add=add)


def head(embedding: nn.Module, x: mx.array, on: bool | Frozen) -> mx.array:
    """``embedding.as_linear(x)`` (a tied head); through the kernel when ``on`` and it fits (its
    dequantizing variant for a quantized embedding)."""
    if on and type(embedding) is nn.Embedding and fits(x, embedding.weight):
        return cuda_matmul.small_matmul_cuda(x, embedding.weight, columns=_columns())
    if on and (qw := _quantized(embedding, x)) is not None:
        return _qmatmul(embedding, x, qw)
    if isinstance(on, Frozen) and type(embedding) is nn.Embedding:
        return x @ transposed(embedding)  # as_linear's product, the transpose made once
    if isinstance(on, Frozen) and type(embedding) is nn.QuantizedEmbedding:
        return _flat_rows(embedding.as_linear, x)
    return embedding.as_linear(x)
