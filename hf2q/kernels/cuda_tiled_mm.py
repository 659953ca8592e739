"""``x @ w.T`` for many rows (a verify of several slots) with the bits of the small-M kernel.

What it does: :func:`tiled_matmul_cuda` computes what :func:`hf2q.kernels.cuda_matmul.small_matmul_cuda`
computes, bit for bit, in two launches laid out for many rows: the first gives each thread block
one K part (the chunks ``kp, kp + KP, ...`` that warp ``kp`` of the small-M kernel sums) of
``BN`` columns for every row, with that K part's slice of ``x`` staged once per chunk in shared
memory and read by all the block's warps; it writes each K part's float32 sums. The second adds
the K parts of every output in order, from 0.0, and rounds once (plus an addend, as the small-M
kernel's residual launch does).

Why: with many rows the small-M kernel keeps a whole row block's accumulators per warp (190-255
registers a thread from 3 m-tiles on, one 8-warp block per SM) and every block reads all of
``x`` for its 8-16 columns: at 128 rows eight times the weight's bytes from L2. On the H200 it
took 66-70 us for a 2560 x 9216 product at 128 rows where cuBLAS took 32-47 (docs/BENCHMARKS.md,
session 18). cuBLAS rounds differently, and a verify row must keep its decode step's bits (bf16
greedy DFlash equals plain decoding), so this kernel keeps the small-M kernel's arithmetic:
every mma gets the same fragments in the same order, the K parts are added in the same order.
Here a block reads ``x`` once for ``BN`` = 64 columns, a warp holds 8 columns of every row (32
accumulators at 128 rows), at the price of the K parts' float32 sums going through memory.

What it does not do: anything :func:`~hf2q.kernels.cuda_matmul.supported` rejects; ``N`` must
be a multiple of 8 (the column tile shrinks to what divides it); products whose K-part sums
would pass :data:`MAX_PART_BYTES` (:func:`takes`). Off unless ``HF2Q_MM_TILED=1`` (from
65 rows) or ``=N`` (from N rows): not measured on a GPU yet.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx

from hf2q.kernels import cuda_matmul as cm

#: Rows from which ``small_matmul_cuda`` hands a product to this kernel with ``HF2Q_MM_TILED=1``
#: (four m-tiles and fewer stay on the small-M kernel, which matched cuBLAS there).
MIN_ROWS = 65
#: Most bytes of K-part sums a launch may write (a 4B-shaped layer's widest product at 128 rows:
#: 8 x 128 x 9216 x 4 = 38 MB; the tied head's 248320 columns would need 1 GB and stay on the
#: small-M kernel).
MAX_PART_BYTES = 64 << 20


def takes(rows: int, K: int, N: int) -> bool:
    """Whether the K-part sums of this product fit :data:`MAX_PART_BYTES` (``small_matmul_cuda``
    hands it to the tiled kernel from ``cuda_matmul.tiled_min_rows()`` rows on)."""
    kparts = cm.launch_shape(rows, K, N)[2]
    return kparts * rows * N * 4 <= MAX_PART_BYTES


# Template arguments: T (bf16/fp16), MT (m-tiles), KP (K parts: the small-M kernel's warps for this
# K), BN (columns per thread block; BN / 8 warps). Output part (KP, M, N) float32.
_PART = r"""
  const int K = x_shape[x_ndim - 1];
  int M = 1;
  for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];
  const int N = w_shape[0];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int kp = blockIdx.x % KP;
  const int n0 = (blockIdx.x / KP) * BN;
  const int col = n0 + warp * 8 + g;
  // One chunk of x: every row's 64 k as 8 uint4, padded to 9 per row against bank conflicts.
  __shared__ uint4 xs[MT * 16][9];
  float acc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mt][e] = 0.0f;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  const int chunks = K / 64;
  for (int c = kp; c < chunks; c += KP) {
    __syncthreads();  // the last chunk's readers are done
    for (int i = threadIdx.x; i < MT * 16 * 8; i += blockDim.x) {
      const int r = i >> 3;
      const int q = i & 7;
      xs[r][q] = r < M ? reinterpret_cast<const uint4*>(x + (size_t)r * K + c * 64)[q] : zero;
    }
    const uint4* wp = reinterpret_cast<const uint4*>(w + (size_t)col * K + c * 64 + 16 * t);
    const uint4 lo = wp[0];
    const uint4 hi = wp[1];
    const unsigned wv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 a_lo = xs[mt * 16 + g][2 * t];
      const uint4 a_hi = xs[mt * 16 + g][2 * t + 1];
      const uint4 b_lo = xs[mt * 16 + g + 8][2 * t];
      const uint4 b_hi = xs[mt * 16 + g + 8][2 * t + 1];
      const unsigned ra[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
      const unsigned rb[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        Hf2qMma<T>::run(acc[mt], ra[2 * j], rb[2 * j], ra[2 * j + 1], rb[2 * j + 1], wv[2 * j],
                        wv[2 * j + 1]);
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = mt * 16 + g + (e >= 2 ? 8 : 0);
      const int cc = n0 + warp * 8 + 2 * t + (e & 1);
      if (row < M) part[((size_t)kp * M + row) * N + cc] = acc[mt][e];
    }
"""

# Template arguments: T, KP. Inputs part (KP, M, N) float32 [and r (M, N) T]; output y (M, N) T:
# the small-M kernel's reduction (0.0 + s0 + s1 + ... in K-part order) and rounding.
_SUM = r"""
  const size_t n = (size_t)part_shape[1] * part_shape[2];
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < KP; ++k) sum += part[k * n + i];
"""
_STORE = "  y[i] = Hf2qMma<T>::to(sum);\n"
_STORE_ADD = "  y[i] = Hf2qMma<T>::add(Hf2qMma<T>::to(sum), r[i]);\n"


@cache
def _part_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_tiled_mm_part",
        input_names=["x", "w"],
        output_names=["part"],
        source=_PART,
        header=cm._HEADER,
    )


@cache
def _sum_kernel(add: bool) -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_tiled_mm_sum" + ("_add" if add else ""),
        input_names=["part", "r"] if add else ["part"],
        output_names=["y"],
        source=_SUM + (_STORE_ADD if add else _STORE),
        header=cm._HEADER,
    )


def column_tile(N: int) -> int:
    """Columns per thread block: 64 (8 warps) or the largest of 32, 16, 8 that divides ``N``."""
    for bn in (64, 32, 16, 8):
        if N % bn == 0:
            return bn
    raise ValueError(f"N={N} is not a multiple of 8")


def tiled_matmul_cuda(x: mx.array, w: mx.array, *, add: mx.array | None = None) -> mx.array:
    """``x @ w.T`` (``+ add``) with the bits of ``cuda_matmul.small_matmul_cuda`` (see module doc)."""
    K, N = w.shape[1], w.shape[0]
    rows = math.prod(x.shape[:-1])
    mt, _, kparts, _ = cm.launch_shape(rows, K, N)
    bn = column_tile(N)
    (part,) = _part_kernel()(
        inputs=[x, w],
        template=[("T", x.dtype), ("MT", mt), ("KP", kparts), ("BN", bn)],
        grid=((N // bn) * kparts * 4 * bn, 1, 1),
        threadgroup=(4 * bn, 1, 1),
        output_shapes=[(kparts, rows, N)],
        output_dtypes=[mx.float32],
    )
    n = rows * N
    threads = 256
    (y,) = _sum_kernel(add is not None)(
        inputs=[part] if add is None else [part, add],
        template=[("T", x.dtype), ("KP", kparts)],
        grid=(-(-n // threads) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*x.shape[:-1], N)],
        output_dtypes=[x.dtype],
    )
    return y
