"""Qwen3.5's gated RMS norm (a Gated-DeltaNet layer's ``norm(y, z)``) in one CUDA launch.

Why: mlx-lm computes ``Qwen3NextRMSNormGated(y, z)`` as two kernels on MLX's CUDA backend,
``mx.fast.rms_norm`` (``rms_norm_small``) and the compiled ``precise_swiglu`` (SiLU of the gate in
float32 times the normed value). A DFlash round of a one-slot 4B-shaped pair is bound by the
host's work per graph node (about 13 us a node on an H100, session 57's trace: 537 kernels a
round against 5.6 ms of device work); the norm is 24 nodes of a verify and 24 of a plain step.
One launch makes them 24 fewer in each.

What it does: :func:`gated_norm_cuda` computes, for each row of ``D`` values (one value head of
one token) ``out = T(silu(f32(z)) * f32(T(w * T(y * r))))`` with ``r = rsqrt(sum(y^2) / D + eps)``
in the order MLX 0.32's ``rms_norm_small`` sums 16-bit rows of up to 512 values: a block of 64
threads, thread i holding values 8i..8i+7 and adding their squares in turn (fused multiply-add),
then cooperative groups' warp tree (lanes i and i+16, i+8, i+4, i+2, i+1), the second warp's
sum after it. Here a warp holds a row, lane i values 8i..8i+7, and its tree is the same one: for
rows of up to 256 values MLX's second warp only adds zeros (the same bits). The weight product
rounds as MLX's 16-bit ``operator*`` does (the exact product, rounded once), the gate's sigmoid
is MLX's CUDA ``Sigmoid`` (``hf2q_sigmoid``), every intermediate rounded where mlx-lm's ops
produce an array.

:func:`norm_rope_cuda` does the same for an attention layer's queries or keys: mlx-lm's
``rope(norm(x).transpose(0, 2, 1, 3), offset)`` (``nn.RMSNorm`` over each head's D values, then
``nn.RoPE`` over the first R of them, the rest kept) in one launch writing (B, H, L, D), where MLX
runs a copy out of the projection's strided view, the norm, a copy for the partial rotation (RoPE
of fewer dims than D copies its input first), the rotation, and the attention launch's copy of
the transposed result: the same norm a warp a head's row (heads of up to 256), each rotated value taken from its partner lane by a shuffle, the
angle as MLX's CUDA RoPE computes it (``exp2(-(i / (R/2)) * log2(base))`` times the position,
its ``cos`` and ``sin``, the same expressions).

What it does not do: rows longer than 256 values or not a multiple of 8, float32 rows (MLX
reduces those with 4 values a thread), or anything off CUDA: :func:`supported` names why, and callers keep
mlx-lm's ``norm`` there. :func:`norm_rope_supported` says the same for heads (of up to 256 values)
and rotations (MLX's ``nn.RoPE``, not traditional, a half of the rotated dims a multiple of 8).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hf2q.kernels.cuda_gated_delta import _HEADER

#: Threads a block (a warp a row: 8 rows).
THREADS = 256

# A row of D values (D <= 256) normed by one warp, as MLX 0.32's rms_norm_small does for 16-bit
# rows of up to 512 values: lane i holds values 8i..8i+7 (all lanes take part in the shuffles;
# those past the rows or the row's end hold zeros) and adds their squares in turn (fused
# multiply-adds), then the warp's tree (lane i + 16, + 8, + 4, + 2, + 1; MLX's second warp only
# adds zeros up to 256 values), r = rsqrt(sum / D + eps), n[j] = T(w * T(x * r)). Needs ``row``,
# ``live_row``, ``src`` (the row's first value in ``X``), ``W`` and constexprs D, EPS.
_NORM = r"""
  const int lane = threadIdx.x % 32;
  const bool live = live_row && lane * 8 < D;
  float v[8];
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    v[j] = live ? hf2q_f(X[src + lane * 8 + j]) : 0.0f;
    acc = fmaf(v[j], v[j], acc);
  }
  acc = hf2q_warp_sum(acc);
  const float r = rsqrtf(acc / D + EPS);
  float n[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    n[j] = live ? hf2q_round<InT>(hf2q_f(W[lane * 8 + j]) * hf2q_round<InT>(v[j] * r)) : 0.0f;
  }
"""

# The gated norm: rows of y (rows, D), the gate z alike; out = T(silu_f32(z) * n).
_SOURCE = (
    r"""
  const int n_rows = y_shape[0];
  const int row = (blockIdx.x * THREADS + threadIdx.x) / 32;
  const bool live_row = row < n_rows;
  const size_t src = (size_t)row * D;
  const InT* X = y;
  const InT* W = w;
"""
    + _NORM
    + r"""
  if (live) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float g = hf2q_f(z[src + lane * 8 + j]);
      out[src + lane * 8 + j] = hf2q_to<InT>((g * hf2q_sigmoid<float>(g)) * n[j]);
    }
  }
"""
)


def _float_literal(value: float) -> str:
    """``value`` rounded to float32 (as MLX passes its kernels eps, or a RoPE's scale), as a C++
    hexadecimal float literal."""
    return float(np.float32(value)).hex() + "f"


def kernel_name(base: str, *constants: float) -> str:
    """``base`` with the float32 bits of the source's ``constants`` appended: MLX 0.32 keeps a
    process's compiled custom kernels by name (and template arguments) only, so two sources
    under one name would run whichever was compiled first (e.g. a target's and a drafter's norm
    of different eps)."""
    return base + "".join(f"_{int(np.float32(c).view(np.uint32)):08x}" for c in constants)


def source(eps: float) -> str:
    """The kernel body for one ``eps`` (a constant of the source)."""
    return (
        f"  constexpr float EPS = {_float_literal(eps)};\n  constexpr int THREADS = {THREADS};\n"
        + _SOURCE
    )


@cache
def _kernel(eps: float) -> Any:
    return mx.fast.cuda_kernel(
        name=kernel_name("hf2q_gated_norm", eps),
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
    if Dv % 8 or Dv > 256:
        return f"rows of {Dv} values (the launch takes multiples of 8 up to 256)"
    return None


def gated_norm_cuda(y: mx.array, z: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``Qwen3NextRMSNormGated(y, z)`` with weight ``weight`` over the last axis, in one launch
    (the module docstring says how). ``y``, ``z`` (..., Dv); returns their shape and dtype."""
    why = supported(y, z, weight)
    if why is not None:
        raise ValueError(f"the gated norm launch cannot take {why}")
    Dv = y.shape[-1]
    rows = y.size // Dv
    threads = -(-rows * 32 // THREADS) * THREADS
    (out,) = _kernel(float(eps))(
        inputs=[y.reshape(rows, Dv), z.reshape(rows, Dv), weight],
        template=[("InT", y.dtype), ("D", Dv)],
        grid=(threads, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, Dv)],
        output_dtypes=[y.dtype],
    )
    return out.reshape(y.shape)


# One warp a row of D values (a head of one token): the norm as in _SOURCE (lanes of 8 values, a
# tree over the warp: for rows of up to 256 values MLX's rms_norm_small sums exactly so), then
# RoPE over the first R values (partner value e + R/2 or e - R/2 from the lane R/16 away, the same
# place in it), the rest kept. x (B, L, H * RS): head h's values at h * RS .. (RS >= D: the q
# projection's queries sit before their gate); off (1,) or (B,) positions of each batch row's
# first token, or (B, L) each row's own position; out (B, H, L, D).
_SOURCE_ROPE = (
    r"""
  const int B = x_shape[0];
  const int L = x_shape[1];
  const int warp = (blockIdx.x * THREADS + threadIdx.x) / 32;
  const bool live_row = warp < B * L * H;
  const int row = live_row ? warp : 0;
  const int h = row % H;
  const int l = (row / H) % L;
  const int b = row / (H * L);
  const size_t src = ((size_t)(b * L + l) * H + h) * RS;
  const InT* X = x;
  const InT* W = w;
"""
    + _NORM
    + r"""
  constexpr int HALF = R / 2;
  constexpr int AWAY = HALF / 8;
  const int partner = lane < AWAY ? lane + AWAY : (lane < 2 * AWAY ? lane - AWAY : lane);
  float p[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    p[j] = __shfl_sync(0xffffffffu, n[j], partner);
  }
  // the row's position: its batch row's first (one for all, or per batch row) + l, or given
  // per (batch row, row) where off is (B, L)
  const int position =
      off_ndim == 2 ? off[(size_t)b * L + l] : off[off_shape[0] == 1 ? 0 : b] + l;
  const float at = SCALE * static_cast<float>(position);
  const size_t dst = (((size_t)b * H + h) * L + l) * D + lane * 8;
  if (live) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = lane * 8 + j;
      float o = n[j];
      if (e < R) {
        const int i = e < HALF ? e : e - HALF;
        const float d = static_cast<float>(i) / static_cast<float>(HALF);
        const float inv_freq = exp2f(-d * BASE);
        const float theta = at * inv_freq;
        const float costheta = cosf(theta);
        const float sintheta = sinf(theta);
        if (e < HALF) {
          const float x1 = n[j];
          const float x2 = p[j];
          o = x1 * costheta - x2 * sintheta;
        } else {
          const float x1 = p[j];
          const float x2 = n[j];
          o = x1 * sintheta + x2 * costheta;
        }
      }
      out[dst + j] = hf2q_to<InT>(o);
    }
  }
"""
)


def rope_source(eps: float, base: float, scale: float) -> str:
    """The norm + RoPE kernel body for one (eps, RoPE base, RoPE scale): constants of the
    source. The base enters as MLX passes it, ``log2`` of the float32 base rounded to float32
    (what ``std::log2(float)`` gives MLX's launch; equal for the bases in use, tested)."""
    log2_base = math.log2(float(np.float32(base)))
    return (
        f"  constexpr float EPS = {_float_literal(eps)};\n"
        f"  constexpr float BASE = {_float_literal(log2_base)};\n"
        f"  constexpr float SCALE = {_float_literal(scale)};\n"
        f"  constexpr int THREADS = {THREADS};\n" + _SOURCE_ROPE
    )


@cache
def _rope_kernel(eps: float, base: float, scale: float) -> Any:
    return mx.fast.cuda_kernel(
        name=kernel_name("hf2q_norm_rope", eps, base, scale),
        input_names=["x", "w", "off"],
        output_names=["out"],
        source=rope_source(eps, base, scale),
        header=_HEADER,
    )


def norm_rope_takes(dtype: Any, norm: Any, rope: Any) -> str | None:
    """None where :func:`norm_rope_cuda` takes heads of ``dtype`` normed by ``norm`` (an
    ``nn.RMSNorm``) and rotated by ``rope`` (an ``nn.RoPE``) with mlx-lm's bits, else why not."""
    D = norm.weight.shape[0]
    if dtype not in (mx.bfloat16, mx.float16) or norm.weight.dtype != dtype:
        return f"rows of {dtype} and a norm of {norm.weight.dtype} (bfloat16 or float16 both)"
    if D % 8 or D > 256:
        return f"heads of {D} values (the launch takes multiples of 8 up to 256)"
    if type(rope) is not nn.RoPE or rope.traditional:
        return f"a {type(rope).__name__}{' (traditional)' if rope.traditional else ''}"
    if rope.dims % 16 or rope.dims > D:
        return f"a rotation of {rope.dims} of {D} values (multiples of 16 up to D)"
    return None


def norm_rope_supported(x: mx.array, norm: Any, rope: Any, heads: int, stride: int) -> str | None:
    """None where :func:`norm_rope_cuda` computes ``rope(norm(heads of x))`` with mlx-lm's
    bits (``x`` (B, L, heads * stride): :func:`norm_rope_takes` and the shape), else why not."""
    D = norm.weight.shape[0]
    if x.ndim != 3 or x.shape[-1] != heads * stride or stride < D:
        return f"an input of shape {x.shape} for {heads} heads of {D} values every {stride}"
    return norm_rope_takes(x.dtype, norm, rope)


def norm_rope_cuda(
    x: mx.array, norm: Any, rope: Any, heads: int, stride: int, offset: mx.array
) -> mx.array:
    """``rope(norm(x.reshape(B, L, heads, stride)[..., :D]).transpose(0, 2, 1, 3), offset)`` in
    one launch (the module docstring says how): (B, heads, L, D) in x's dtype. ``offset``: an
    int32 array of one position for every batch row, or one per batch row (B,), the first of
    the row's L consecutive positions; or each row's own position (B, L)."""
    why = norm_rope_supported(x, norm, rope, heads, stride)
    if why is not None:
        raise ValueError(f"the norm + RoPE launch cannot take {why}")
    B, L, _ = x.shape
    D = norm.weight.shape[0]
    off = offset if offset.ndim == 2 else offset.reshape(-1)
    if off.ndim == 2 and off.shape != (B, L):
        raise ValueError(f"positions {off.shape} for rows of {(B, L)}")
    if off.dtype != mx.int32:
        off = off.astype(mx.int32)
    threads = -(-B * L * heads * 32 // THREADS) * THREADS
    kernel = _rope_kernel(float(norm.eps), float(rope.base), float(rope.scale))
    (out,) = kernel(
        inputs=[x, norm.weight, off],
        template=[("InT", x.dtype), ("H", heads), ("RS", stride), ("D", D), ("R", rope.dims)],
        grid=(threads, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, heads, L, D)],
        output_dtypes=[x.dtype],
    )
    return out


__all__ = [
    "gated_norm_cuda",
    "norm_rope_cuda",
    "norm_rope_supported",
    "norm_rope_takes",
    "supported",
]
