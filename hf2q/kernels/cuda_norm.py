"""Qwen3.5's gated RMS norm (a Gated-DeltaNet layer's ``norm(y, z)``) in one CUDA launch.

Why: mlx-lm computes ``Qwen3NextRMSNormGated(y, z)`` as two kernels on MLX's CUDA backend,
``mx.fast.rms_norm`` (``rms_norm_small``) and the compiled ``precise_swiglu`` (SiLU of the gate in
float32 times the normed value). A DFlash round of a one-slot 4B-shaped pair is bound by the
host's work per graph node (about 13 us a node on an H100, session 57's trace: 537 kernels a
round against 5.6 ms of device work); the norm is 24 nodes of a verify and 24 of a plain step.
One launch makes them 24 fewer in each.

What it does: :func:`gated_norm_cuda` computes, for each row of ``Dv`` values (one value head of
one token) ``out = T(silu(f32(z)) * f32(T(w * T(y * r))))`` with ``r = rsqrt(sum(y^2) / Dv + eps)``
in the order MLX 0.32's ``rms_norm_small`` sums 16-bit rows of up to 512 values: a block of 64
threads, thread i holding values 8i..8i+7 and adding their squares in turn (fused multiply-add),
then cooperative groups' warp tree (lanes i and i+16, i+8, i+4, i+2, i+1), the second warp's
zeros after it. Here 16 lanes hold a row (two rows a warp) and their tree is the same one without
the first step, which only adds zeros for rows of up to 128 values: the same bits. The weight
product rounds as MLX's 16-bit ``operator*`` does (the exact product, rounded once), the gate's
sigmoid is MLX's CUDA ``Sigmoid`` (``hf2q_sigmoid``), every intermediate rounded where mlx-lm's
ops produce an array.

What it does not do: rows longer than 128 values or not a multiple of 8, float32 rows (MLX
reduces those over 32 lanes), or anything off CUDA: :func:`supported` names why, and callers keep
mlx-lm's ``norm`` there.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from hf2q.kernels.cuda_gated_delta import _HEADER

#: Values a lane holds (MLX's 16 bytes a load of a 16-bit row).
PER_LANE = 8
#: Lanes a row: rows of up to ``PER_LANE * LANES`` values.
LANES = 16
#: Threads a block (16 rows).
THREADS = 256

_SOURCE = r"""
  const int n_rows = y_shape[0];
  const int gtid = blockIdx.x * THREADS + threadIdx.x;
  const int row = gtid / 16;
  const int i = gtid % 16;
  // Every lane takes part in the shuffles; lanes past the rows or the row's end hold zeros.
  const bool live = row < n_rows && i * 8 < Dv;
  const size_t base = (size_t)row * Dv + i * 8;
  float xs[8];
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xs[j] = live ? hf2q_f(y[base + j]) : 0.0f;
    acc = fmaf(xs[j], xs[j], acc);
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 8);
  acc += __shfl_xor_sync(0xffffffffu, acc, 4);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  const float r = rsqrtf(acc / Dv + EPS);
  if (live) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float normed = hf2q_round<InT>(hf2q_f(w[i * 8 + j]) * hf2q_round<InT>(xs[j] * r));
      const float g = hf2q_f(z[base + j]);
      out[base + j] = hf2q_to<InT>((g * hf2q_sigmoid<float>(g)) * normed);
    }
  }
"""


def _eps_literal(eps: float) -> str:
    """``eps`` as the float32 value MLX passes its kernel (a C++ hexadecimal float literal)."""
    return float(np.float32(eps)).hex() + "f"


def source(eps: float) -> str:
    """The kernel body for one ``eps`` (a constant of the source)."""
    return (
        f"  constexpr float EPS = {_eps_literal(eps)};\n  constexpr int THREADS = {THREADS};\n"
        + _SOURCE
    )


@cache
def _kernel(eps: float) -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_gated_norm",
        input_names=["y", "z", "w"],
        output_names=["out"],
        source=source(eps),
        header=_HEADER,
    )


def supported(y: mx.array, z: mx.array, weight: mx.array) -> str | None:
    """None where :func:`gated_norm_cuda` computes ``norm(y, z)`` with mlx-lm's bits, else why not."""
    Dv = y.shape[-1]
    if y.dtype not in (mx.bfloat16, mx.float16):
        return f"rows of {y.dtype} (the launch takes bfloat16 and float16)"
    if z.dtype != y.dtype or weight.dtype != y.dtype:
        return f"dtypes {y.dtype}, {z.dtype}, {weight.dtype} differ"
    if z.shape != y.shape or weight.shape != (Dv,):
        return f"shapes {y.shape}, {z.shape}, {weight.shape} do not match"
    if Dv % PER_LANE or Dv > PER_LANE * LANES:
        return f"rows of {Dv} values (the launch takes multiples of 8 up to 128)"
    return None


def gated_norm_cuda(y: mx.array, z: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``Qwen3NextRMSNormGated(y, z)`` with weight ``weight`` over the last axis, in one launch
    (the module docstring says how). ``y``, ``z`` (..., Dv); returns their shape and dtype."""
    why = supported(y, z, weight)
    if why is not None:
        raise ValueError(f"the gated norm launch cannot take {why}")
    Dv = y.shape[-1]
    rows = y.size // Dv
    threads = -(-rows * LANES // THREADS) * THREADS
    (out,) = _kernel(float(eps))(
        inputs=[y.reshape(rows, Dv), z.reshape(rows, Dv), weight],
        template=[("InT", y.dtype), ("Dv", Dv)],
        grid=(threads, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, Dv)],
        output_dtypes=[y.dtype],
    )
    return out.reshape(y.shape)


__all__ = ["gated_norm_cuda", "supported"]
