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

What it does not do: quantized layers, float32, training (the kernel has no gradient: training
never passes ``on``), or products with many rows of a large weight (cuBLAS is faster there).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn

from hf2q.kernels import cuda_matmul

#: Rows always sent to the kernel when it supports the product.
ALWAYS_ROWS = 32
#: Weights up to this many elements go to the kernel up to ``cuda_matmul.MAX_ROWS`` rows (the
#: product stays launch-bound; beyond it, with more than ``ALWAYS_ROWS`` rows, cuBLAS wins).
SMALL_WEIGHT = 1 << 22


def fits(x: mx.array, w: mx.array) -> bool:
    """Whether the kernel computes ``x @ w.T`` (dtypes, shapes, rows; see module doc)."""
    if cuda_matmul.supported(x, w) is not None:
        return False
    rows = x.size // x.shape[-1]
    return rows <= ALWAYS_ROWS or w.size <= SMALL_WEIGHT


def linear(mod: nn.Module, x: mx.array, on: bool) -> mx.array:
    """``mod(x)``; through the kernel when ``on`` and ``mod`` is a plain ``nn.Linear`` that fits."""
    if on and type(mod) is nn.Linear and fits(x, mod.weight):
        y = cuda_matmul.small_matmul_cuda(x, mod.weight)
        return y + mod.bias if "bias" in mod else y
    return mod(x)


@cache
def _swiglu_types() -> tuple[type, ...]:
    from mlx_lm.models.qwen3 import MLP
    from mlx_lm.models.qwen3_next import Qwen3NextMLP

    return (MLP, Qwen3NextMLP)


def swiglu_mlp(mlp: nn.Module, x: mx.array, on: bool) -> mx.array:
    """mlx-lm's SwiGLU MLP (``down(silu(gate(x)) * up(x))``) with its products through :func:`linear`.

    Only mlx-lm's dense Qwen3 / Qwen3-Next MLP classes, whose call is exactly that; anything else
    (the sparse MoE block, other MLPs) runs its own call.
    """
    if not on or type(mlp) not in _swiglu_types():
        return mlp(x)
    from mlx_lm.models.activations import swiglu

    return linear(
        mlp.down_proj, swiglu(linear(mlp.gate_proj, x, on), linear(mlp.up_proj, x, on)), on
    )


def head(embedding: nn.Module, x: mx.array, on: bool) -> mx.array:
    """``embedding.as_linear(x)`` (a tied head); through the kernel when ``on`` and it fits."""
    if on and type(embedding) is nn.Embedding and fits(x, embedding.weight):
        return cuda_matmul.small_matmul_cuda(x, embedding.weight)
    return embedding.as_linear(x)
