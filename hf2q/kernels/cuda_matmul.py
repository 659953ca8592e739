"""Small-M matrix products ``x @ w.T`` on tensor cores for MLX's CUDA backend.

What it does: ``small_matmul_cuda(x, w)`` computes ``x @ w.T`` for a bf16 or fp16 activation
``x`` of shape ``(..., K)`` with at most :data:`MAX_ROWS` rows and an unquantized linear weight
``w`` of shape ``(N, K)`` (``nn.Linear``'s layout), in one ``mx.fast.cuda_kernel`` launch with
``mma.sync.m16n8k16`` (float32 accumulation, one rounding to the output dtype).

Why: a DFlash verify multiplies 16 rows per slot, a draft 16 block rows plus the context rows.
MLX runs every product with more than one row through cuBLASLt, and on its CUDA backend each of
those is a descriptor set-up, an algorithm heuristic query and a stream capture on the host,
while a custom kernel is one graph node. At the sizes where DFlash pays the products are
bandwidth-bound (16 rows read the weight once), so a kernel that streams the weight once with
tensor cores costs the device what cuBLAS does and the host much less.

Layout of the work: a thread block of ``WARPS`` warps owns ``8 * NB`` output columns; its warps
split K in chunks of 64. Lane ``(g, t)`` (``g = lane / 4``, ``t = lane % 4``) loads 16
consecutive weights of column ``g`` and 16 consecutive inputs of rows ``g`` and ``g + 8`` per
chunk (two 16-byte loads each, coalesced), and feeds them to four mma steps. The dot product is
order-free, so the mma's logical k index ``2t + {0, 1}`` / ``2t + 8 + {0, 1}`` of step ``j`` is
mapped to the physical k ``16t + 4j + {0, 1}`` / ``16t + 4j + {2, 3}`` in both operands: each
lane's loads are contiguous. Warps' partial sums are added in shared memory in warp order.

Each output row is computed the same way whatever the other rows hold and however many rows
there are (same chunk order, same mma lane, same warp order), so a row's result does not depend
on M: one row alone and the same row inside a 16-row verify give the same bits.

What it does not do: quantized weights, float32, K not a multiple of 64, N not a multiple of 8,
or more than :data:`MAX_ROWS` rows (:func:`supported` says so; callers use ``mx.matmul``). Loads
are 16 bytes wide: inputs must start 16-byte aligned, which MLX's buffers and the row-contiguous
views hf2q passes (whole rows of K, a multiple of 64 elements) do; non-contiguous inputs are
copied by MLX first.
"""

from __future__ import annotations

import math
import os
from functools import cache
from typing import Any

import mlx.core as mx

from hf2q.errors import UsageError
from hf2q.kernels import cuda_gated_delta, cuda_norm

#: Most rows one launch takes (8 m-tiles of 16: eight slots of a 16-token verify).
MAX_ROWS = 128
#: K is consumed in chunks of this many elements (four mma k-steps).
K_CHUNK = 64
#: Static shared memory a thread block may use on sm_90 (ptxas: 0x38c00 bytes).
SHARED_BYTES = 0x38C00

_HEADER = r"""
// D += A (16x16, row) * B (16x8, col) for one warp, float32 accumulators (PTX mma.m16n8k16).
// Under HF2Q_EMULATED_MMA (the CPU test harness, tests/cuda_emu.py) the harness provides the
// same warp-collective product from the PTX fragment layout.
#ifdef HF2Q_EMULATED_MMA
#define HF2Q_MMA(KIND, IS_BF16)                                                          \
  hf2q_emulated_mma(IS_BF16, c, a0, a1, a2, a3, b0, b1);
#else
#define HF2Q_MMA(KIND, IS_BF16)                                                          \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." KIND "." KIND ".f32 "            \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                         \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
// One 16-byte copy from global to shared memory that does not wait (cp.async, sm_80 and later),
// its commit group, and the wait for all but the N newest groups. The emulator copies at once.
#ifdef HF2Q_EMULATED_MMA
#define HF2Q_CP_ASYNC16(DST, SRC) \
  (*reinterpret_cast<uint4*>(DST) = *reinterpret_cast<const uint4*>(SRC))
#define HF2Q_CP_COMMIT()
#define HF2Q_CP_WAIT(N)
#else
#define HF2Q_CP_ASYNC16(DST, SRC)                                                        \
  asm volatile("{ .reg .u64 p; cvta.to.shared.u64 p, %0;\n"                               \
               "cp.async.cg.shared.global [p], [%1], 16; }\n" ::"l"(DST), "l"(SRC)        \
               : "memory")
#define HF2Q_CP_COMMIT() asm volatile("cp.async.commit_group;\n" ::: "memory")
#define HF2Q_CP_WAIT(N) asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory")
#endif
template <typename T> struct Hf2qMma;
template <> struct Hf2qMma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    HF2Q_MMA("bf16", true)
  }
  static __device__ __forceinline__ __nv_bfloat16 to(float x) { return __float2bfloat16(x); }
  static __device__ __forceinline__ __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __hadd(a, b);
  }
};
template <> struct Hf2qMma<__half> {
  static __device__ __forceinline__ void run(float* c, unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    HF2Q_MMA("f16", false)
  }
  static __device__ __forceinline__ __half to(float x) { return __float2half(x); }
  static __device__ __forceinline__ __half add(__half a, __half b) { return __hadd(a, b); }
};
"""

# Template arguments: T (bf16/fp16), MT (m-tiles of 16 rows), NB (8-column blocks per thread
# block), WARPS, U (unrolling of the chunk loop). Inputs x (..., K) with M rows in all and w (N, K),
# both row-contiguous; output y (..., N).
_ROWS = r"""
  const int K = x_shape[x_ndim - 1];
  int M = 1;
  for (int i = 0; i < x_ndim - 1; ++i) M *= x_shape[i];
"""

# The product itself, for a weight ``w`` (N, K) and output ``y`` whose columns n0 .. n0 + 8 * NB
# this thread block computes (the single kernel and the grouped one each say which), each value
# written by ``store(index, float32 sum)``; ``@LOAD_W@`` is where a chunk's weights are loaded
# into ``wv`` (:data:`_LOAD_W` for unquantized weights, :data:`_LOAD_WQ` for quantized ones).
_BODY_LOOP_MARKED = r"""
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
@NORM_PRE@
  float acc[MT][NB][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nb][e] = 0.0f;
  const int chunks = K / 64;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll U
  for (int c = warp; c < chunks; c += WARPS) {
    const int kb = c * 64 + 16 * t;
@LOAD_W@
@NORM_W@
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r0 = mt * 16 + g;
      const int r1 = r0 + 8;
      uint4 a_lo = zero, a_hi = zero, b_lo = zero, b_hi = zero;
      if (r0 < M) {
        const uint4* xp = reinterpret_cast<const uint4*>(@XROW(r0)@ + kb);
        a_lo = xp[0];
        a_hi = xp[1];
      }
      if (r1 < M) {
        const uint4* xp = reinterpret_cast<const uint4*>(@XROW(r1)@ + kb);
        b_lo = xp[0];
        b_hi = xp[1];
      }
@NORM_X@
      const unsigned ra[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
      const unsigned rb[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          Hf2qMma<T>::run(acc[mt][nb], ra[2 * j], rb[2 * j], ra[2 * j + 1], rb[2 * j + 1],
                          wv[nb][2 * j], wv[nb][2 * j + 1]);
        }
      }
    }
  }
"""
# The x rows normed in the launch (:func:`small_matmul_cuda`'s ``norm``): ``nw`` the norm's weight
# (K,), EPS a constant of the source. Before the products, each row's 1 / rms in shared memory,
# summed in the order MLX 0.32.4's ``rms_norm_small`` sums a row of up to 8192 16-bit values: a
# block of BS threads (64 or 128) a row, thread t squaring and adding (fused multiply-adds, in
# turn) the 8 values of each of its CH vectors t, BS + t, ..., (CH - 1) BS + t (vectors of 8
# values; those past the row are zeros), each warp adding its threads' sums by the tree
# lane + 16, + 8, + 4, + 2, + 1, and the warps' sums, at lanes 0 .. of one warp with zeros past
# them, by the same tree. BS and CH follow MLX's dispatch on K (:data:`_NORM_SHAPE`). Here the
# block's warps take the (row, MLX warp) pairs in turn (independent loads, in flight together),
# each pair's sum kept in shared memory, then a warp a row adds them by the second tree. Then
# r = rsqrt(sum / K + eps), and each x value the products load is replaced by
# ``T(w * T(x * r))``, MLX's output of the norm: the products multiply the very values
# ``mx.fast.rms_norm`` would have written. The whole row is read once more a thread block, so
# this suits launches of few rows (the callers' row limit).
_NORM_SHAPE = r"""
    const int nvec = K / 8;
    int bs = 128;
    int ch = (nvec + 127) / 128;
    if (K <= 512) {
      bs = 64;
      ch = 1;
    } else if (nvec % 128 == 0 && nvec / 128 <= 8) {
      ch = nvec / 128;
    } else if (nvec % 64 == 0 && nvec / 64 <= 8) {
      bs = 64;
      ch = nvec / 64;
    }
    const int mws = bs / 32;
"""
_NORM_PRE = (
    r"""
  __shared__ float hf2q_rinv[MT * 16];
  __shared__ float hf2q_part[MT * 16][4];
  {
    const int rows = M < MT * 16 ? M : MT * 16;
"""
    + _NORM_SHAPE
    + r"""
    for (int p = warp; p < rows * mws; p += WARPS) {
      const int row = p / mws;
      if (!(@NORMED(row)@)) continue;
      const int tid = (p % mws) * 32 + lane;
      float acc = 0.0f;
      for (int i = 0; i < ch; ++i) {
        const int base = (bs * i + tid) * 8;
        if (base < K) {
          const uint4 v = *reinterpret_cast<const uint4*>(@XROW(row)@ + base);
          T vs[8];
          memcpy(vs, &v, 16);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float f = hf2q_f(vs[j]);
            acc = fmaf(f, f, acc);
          }
        }
      }
      acc = hf2q_warp_sum(acc);
      if (lane == 0) hf2q_part[row][p % mws] = acc;
    }
    __syncthreads();
    for (int row = warp; row < rows; row += WARPS) {
      const float s = hf2q_warp_sum(lane < mws ? hf2q_part[row][lane] : 0.0f);
      if (lane == 0) hf2q_rinv[row] = rsqrtf(s / K + EPS);
    }
    __syncthreads();
  }
"""
)
_NORM_W = r"""
    const uint4* nwp = reinterpret_cast<const uint4*>(nw + kb);
    const uint4 nw_lo = nwp[0];
    const uint4 nw_hi = nwp[1];
"""
_NORM_X = r"""
      if (r0 < M && @NORMED(r0)@) {
        a_lo = hf2q_norm8<T>(a_lo, nw_lo, hf2q_rinv[r0]);
        a_hi = hf2q_norm8<T>(a_hi, nw_hi, hf2q_rinv[r0]);
      }
      if (r1 < M && @NORMED(r1)@) {
        b_lo = hf2q_norm8<T>(b_lo, nw_lo, hf2q_rinv[r1]);
        b_hi = hf2q_norm8<T>(b_hi, nw_hi, hf2q_rinv[r1]);
      }
"""
# Eight T values of x normed with their eight weights: T(w * T(x * r)) each (the product of two
# 16-bit values is exact in float32, so one rounding, as MLX's T product).
_NORM_HEADER = r"""
template <typename T>
__device__ __forceinline__ uint4 hf2q_norm8(uint4 xv, uint4 wv, float r) {
  T xs[8], ws[8], os[8];
  memcpy(xs, &xv, 16);
  memcpy(ws, &wv, 16);
#pragma unroll
  for (int j = 0; j < 8; ++j) os[j] = hf2q_to<T>(hf2q_f(ws[j]) * hf2q_round<T>(hf2q_f(xs[j]) * r));
  uint4 o;
  memcpy(&o, os, 16);
  return o;
}
"""


def _normed(body: str, norm: bool, joined: bool = False) -> str:
    """``body`` with the norm's pieces (:data:`_NORM_PRE`) where ``norm``, else without them;
    ``joined``: x's rows are a context's then x's (:data:`_JOINED_ROWS`), only x's normed."""
    pieces = {"@NORM_PRE@\n": _NORM_PRE[1:], "@NORM_W@\n": _NORM_W[1:], "@NORM_X@\n": _NORM_X[1:]}
    for mark, piece in pieces.items():
        body = body.replace(mark, piece if norm else "")
    for r in ("r0", "r1", "row"):
        body = body.replace(f"@XROW({r})@", f"hf2q_xrow({r})" if joined else f"x + (size_t){r} * K")
        body = body.replace(f"@NORMED({r})@", f"hf2q_normed_row({r})" if joined else "true")
    return body


# The warps' partial sums staged in shared memory for their sum (K-split, WARPS > 1).
_STAGE_PARTIALS = r"""
  __shared__ float red[WARPS][SLOTS][32];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][(mt * NB + nb) * 4 + e][lane] = acc[mt][nb][e];
  __syncthreads();
"""
# One warp: each lane stores its accumulators as they are.
_BODY_ONE_WARP = r"""
  constexpr int SLOTS = MT * NB * 4;
  if (WARPS == 1) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int mt = s / (NB * 4);
      const int nb = (s / 4) % NB;
      const int e = s % 4;
      const int row = mt * 16 + g + (e >= 2 ? 8 : 0);
      const int col = n0 + nb * 8 + 2 * t + (e & 1);
      if (row < M) store((size_t)row * N + col, acc[mt][nb][e]);
    }
    return;
  }
"""
# Several: the partials added in warp order, from 0.0f.
_BODY_SUM = r"""
  for (int i = threadIdx.x; i < SLOTS * 32; i += WARPS * 32) {
    const int s = i / 32;
    const int ln = i % 32;
    const int mt = s / (NB * 4);
    const int row = mt * 16 + (ln >> 2) + ((s % 4) >= 2 ? 8 : 0);
    if (row >= M) continue;
    float sum = 0.0f;
#pragma unroll
    for (int ww = 0; ww < WARPS; ++ww) sum += red[ww][s][ln];
    const int col = n0 + ((s / 4) % NB) * 8 + 2 * (ln & 3) + (s & 1);
    store((size_t)row * N + col, sum);
  }
"""


def _k_split_body(load_w: str, norm: bool = False, joined: bool = False) -> str:
    """The K-split products' body, a chunk's weights loaded by ``load_w`` (:data:`_LOAD_W`,
    :data:`_LOAD_WQ`); with ``norm`` the rows normed in the launch, ``joined`` see
    :func:`_normed`."""
    loop = _normed(_BODY_LOOP_MARKED, norm, joined)
    body = loop + _BODY_ONE_WARP[1:] + _STAGE_PARTIALS[1:] + _BODY_SUM[1:]
    return body.replace("@LOAD_W@\n", load_w[1:])


# The unquantized weights' loads: the 16 bf16/fp16 weights of the lane's column in this chunk,
# column block nb's row of weights starting at @W_ROW@ (:data:`_LOAD_W`: of ``w``).
_LOAD_W_ROWS = r"""
    unsigned wv[NB][8];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint4* wp = reinterpret_cast<const uint4*>(@W_ROW@ + kb);
      const uint4 lo = wp[0];
      const uint4 hi = wp[1];
      wv[nb][0] = lo.x; wv[nb][1] = lo.y; wv[nb][2] = lo.z; wv[nb][3] = lo.w;
      wv[nb][4] = hi.x; wv[nb][5] = hi.y; wv[nb][6] = hi.z; wv[nb][7] = hi.w;
    }
"""
_LOAD_W = _LOAD_W_ROWS.replace("@W_ROW@", "w + (size_t)(n0 + nb * 8 + g) * K")
_BODY = _k_split_body(_LOAD_W)
_BODY_NORMED = _k_split_body(_LOAD_W, norm=True)


# The same products with the warps splitting the columns instead of K (CW warps, each NB * 8 of
# the block's 8 * NB * CW columns): each warp runs every chunk itself, K-subset by K-subset in
# the order of _BODY's warps (subset s: chunks s, s + WARPS, ...), one subset's accumulators
# added to a running sum (from 0.0f, subset 0 first) when the subset ends: per output element
# the very operations of _BODY (the same mma on the same fragments per chunk, then
# 0 + P_0 + P_1 + ... in float32, the running sums kept in shared memory, each lane its own):
# the same bits. What changes is the traffic: the chunk of x
# all the block's warps multiply is loaded once per block into shared memory instead of once
# per warp from L2, so at many rows the weight stream is no longer a third of what a block
# reads. Each warp's weights and the block's x are loaded D chunks ahead of the one multiplied
# (template argument D: 1, the next chunk only, as sessions 26-56 timed it; 2 or 3 keep more in
# flight with the few blocks this layout has, each warp walking all of K), the weights into a
# ring of D + 1 register sets whose index is a constant in the loop unrolled D + 1 times (the
# order of the chunks and of their sums is D's business nowhere).
# Staged rows are 72 elements apart (144 bytes): a quarter warp's 16-byte fragment reads
# (rows g, g + 1, k offsets 16 t) fall in eight distinct bank groups. WARPS > 1 only (the
# running sum starts at 0.0f as _BODY's sum of the warps' partials does; one warp stores its
# accumulators as they are).
_COLUMNS_PRE = r"""
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int nw = n0 + warp * (8 * NB);
  constexpr int XR = MT * 16;
  constexpr int XP = 72;
  constexpr int XV = XR * 8;
  constexpr int XL = (XV + 32 * CW - 1) / (32 * CW);
  constexpr int XS = D == 1 ? 2 : D + 2;  // staged chunks of x
  __shared__ __align__(16) T xs[XS][XR * XP];
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  __shared__ float sum[CW][MT * NB * 4][32];
  float acc[MT][NB][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[mt][nb][e] = 0.0f;
        sum[warp][(mt * NB + nb) * 4 + e][lane] = 0.0f;
      }
  const int chunks = K / 64;
  auto load_w = [&](int c, unsigned (&dst)[NB][8]) {
    const int kb = c * 64 + 16 * t;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint4* wp = reinterpret_cast<const uint4*>(w + (size_t)(nw + nb * 8 + g) * K + kb);
      const uint4 lo = wp[0];
      const uint4 hi = wp[1];
      dst[nb][0] = lo.x; dst[nb][1] = lo.y; dst[nb][2] = lo.z; dst[nb][3] = lo.w;
      dst[nb][4] = hi.x; dst[nb][5] = hi.y; dst[nb][6] = hi.z; dst[nb][7] = hi.w;
    }
  };
  // The chunk staged in xs[buf] times the weights in wq, into acc.
  auto multiply = [&](int buf, const unsigned (&wq)[NB][8]) {
    const T* xb = xs[buf];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4* pa = reinterpret_cast<const uint4*>(xb + (mt * 16 + g) * XP + 16 * t);
      const uint4* pb = reinterpret_cast<const uint4*>(xb + (mt * 16 + g + 8) * XP + 16 * t);
      const uint4 a_lo = pa[0], a_hi = pa[1], b_lo = pb[0], b_hi = pb[1];
      const unsigned ra[8] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
      const unsigned rb[8] = {b_lo.x, b_lo.y, b_lo.z, b_lo.w, b_hi.x, b_hi.y, b_hi.z, b_hi.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          Hf2qMma<T>::run(acc[mt][nb], ra[2 * j], rb[2 * j], ra[2 * j + 1], rb[2 * j + 1],
                          wq[nb][2 * j], wq[nb][2 * j + 1]);
        }
      }
    }
  };
  // A K-subset's accumulators into the running sum (in subset order), then cleared.
  auto fold = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sum[warp][(mt * NB + nb) * 4 + e][lane] += acc[mt][nb][e];
          acc[mt][nb][e] = 0.0f;
        }
  };
  // The chunk after c in the visiting order (subset s's chunks, then subset s + 1's).
  auto advance = [&](int& s_, int& c_) {
    c_ += WARPS;
    if (c_ >= chunks) {
      s_ += 1;
      c_ = s_;
    }
  };
  int s = 0;
  int c = 0;
"""
# D == 1: the next chunk's weights loaded while this one is multiplied (sessions 26-56).
_COLUMNS_NEXT = r"""
    // x's chunk c_ into registers, then (after this chunk's products) into xs[buf].
    uint4 xr[XL];
    auto load_x = [&](int c_) {
#pragma unroll
      for (int p = 0; p < XL; ++p) {
        const int i = threadIdx.x + p * 32 * CW;
        const int row = i >> 3;
        xr[p] = zero;
        if (i < XV && row < M)
          xr[p] = *reinterpret_cast<const uint4*>(x + (size_t)row * K + c_ * 64 + (i & 7) * 8);
      }
    };
    auto store_x = [&](int buf) {
#pragma unroll
      for (int p = 0; p < XL; ++p) {
        const int i = threadIdx.x + p * 32 * CW;
        if (i < XV) *reinterpret_cast<uint4*>(&xs[buf][(i >> 3) * XP + (i & 7) * 8]) = xr[p];
      }
    };
    unsigned wv[NB][8];
    unsigned wn[NB][8];
    load_x(c);
    store_x(0);
    load_w(c, wv);
    __syncthreads();
#pragma unroll U
    for (int it = 0; it < chunks; ++it) {
      int sn = s;
      int cn = c;
      advance(sn, cn);
      const bool more = it + 1 < chunks;
      if (more) {
        load_x(cn);
        load_w(cn, wn);
      }
      multiply(it & 1, wv);
      if (sn != s || !more) fold();
      if (more) {
        store_x((it + 1) & 1);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 8; ++e) wv[nb][e] = wn[nb][e];
      }
      __syncthreads();
      s = sn;
      c = cn;
    }
"""
# D > 1: a ring of D + 1 weight sets, the chunk D ahead loaded into the set the last chunk used,
# and x's chunk D ahead copied into shared memory with cp.async (D + 2 buffers, one barrier a
# chunk): no registers held for it, and its latency hidden behind D chunks' products, where the
# D == 1 loop waits for the next chunk's x within one (session 57: with the weights 3 chunks
# ahead but x one, the 4-slot round's gate/up took 88.7 us a launch against the K-split's 56.9).
_COLUMNS_AHEAD = r"""
    unsigned wr[D + 1][NB][8];
    // x's chunk c copied into xs[buf] without waiting (rows past M zeroed), the copy one group.
    auto copy_x = [&](int c_, int buf) {
#pragma unroll
      for (int p = 0; p < XL; ++p) {
        const int i = threadIdx.x + p * 32 * CW;
        const int row = i >> 3;
        T* dst = &xs[buf][row * XP + (i & 7) * 8];
        if (i < XV && row < M)
          HF2Q_CP_ASYNC16(dst, x + (size_t)row * K + c_ * 64 + (i & 7) * 8);
        else if (i < XV)
          *reinterpret_cast<uint4*>(dst) = zero;
      }
    };
    int ls = 0;  // the next chunk whose weights and x are loaded (its K-subset, its index)
    int lc = 0;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      if (d < chunks) {
        load_w(lc, wr[d]);
        copy_x(lc, d);
        advance(ls, lc);
      }
      HF2Q_CP_COMMIT();
    }
    for (int base = 0; base < chunks; base += D + 1) {
#pragma unroll
      for (int r = 0; r <= D; ++r) {
        const int it = base + r;
        if (it < chunks) {
          int sn = s;
          int cn = c;
          advance(sn, cn);
          if (it + D < chunks) {
            load_w(lc, wr[(r + D) % (D + 1)]);
            copy_x(lc, (it + D) % XS);
            advance(ls, lc);
          }
          HF2Q_CP_COMMIT();
          // This chunk's copies done (the D newest groups may not be), everyone's seen: the
          // buffer written next (D + 2 chunks on) was last read two barriers ago.
          HF2Q_CP_WAIT(D);
          __syncthreads();
          multiply(it % XS, wr[r]);
          if (sn != s || it + 1 == chunks) fold();
          s = sn;
          c = cn;
        }
      }
    }
"""
_COLUMNS_POST = r"""
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = mt * 16 + g + (e >= 2 ? 8 : 0);
        const int col = nw + nb * 8 + 2 * t + (e & 1);
        if (row < M) store((size_t)row * N + col, sum[warp][(mt * NB + nb) * 4 + e][lane]);
      }
"""
_BODY_COLUMNS = (
    _COLUMNS_PRE
    + "  if (D == 1) {"
    + _COLUMNS_NEXT
    + "  } else {"
    + _COLUMNS_AHEAD
    + "  }"
    + _COLUMNS_POST
)


_SINGLE = r"""
  const int N = w_shape[0];
  const int n0 = blockIdx.x * (8 * NB * CW);
"""
_STORE = r"""
  auto store = [&](size_t i, float v) { y[i] = Hf2qMma<T>::to(v); };
"""
_SOURCE = _ROWS + _SINGLE + _STORE + _BODY
_SOURCE_COLUMNS = _ROWS + _SINGLE + _STORE + _BODY_COLUMNS

# With an addend r (same shape as y): the product rounded to T, then r added as MLX adds two
# T arrays (one rounding of the exact sum): the bits of ``small_matmul_cuda(x, w) + r``, in the
# same launch (a residual connection after a layer's last product).
_STORE_ADD = r"""
  auto store = [&](size_t i, float v) { y[i] = Hf2qMma<T>::add(Hf2qMma<T>::to(v), r[i]); };
"""
_SOURCE_ADD = _ROWS + _SINGLE + _STORE_ADD + _BODY
_SOURCE_ADD_COLUMNS = _ROWS + _SINGLE + _STORE_ADD + _BODY_COLUMNS


# A grouped launch whose rows are a context's then x's, as ``concatenate([c, x], axis=-2)``
# would give them (c (..., PJ, K), x (..., LJ, K), the same leading axes), without that copy:
# row r of the launch is row j = r % (PJ + LJ) of batch b = r / (PJ + LJ), c's where j < PJ.
# Only x's rows are normed (a drafter layer's block rows through its input norm, its context
# rows as they come: the k and v products of a DFlash drafter layer).
_JOINED_ROWS = r"""
  const int PJ = c_shape[c_ndim - 2];
  const int LJ = x_shape[x_ndim - 2];
  const int TJ = PJ + LJ;
  M = M / LJ * TJ;
  auto hf2q_xrow = [&](int r) -> const T* {
    const int b = r / TJ;
    const int j = r - b * TJ;
    return j < PJ ? c + ((size_t)b * PJ + j) * K : x + ((size_t)b * LJ + (j - PJ)) * K;
  };
  auto hf2q_normed_row = [&](int r) -> bool { return r % TJ >= PJ; };
"""


def grouped_source(
    groups: int, columns: bool = False, norm: bool = False, joined: bool = False
) -> str:
    """The kernel body computing ``x @ w{i}.T`` into ``y{i}`` for ``groups`` weights of one K in one
    launch: the thread blocks are laid out weight after weight, and each block runs
    :data:`_BODY` (:data:`_BODY_COLUMNS` with ``columns``, the normed body with ``norm``) on its
    own weight's columns, so every output element is computed exactly as the single-weight
    kernel computes it (same chunks, lanes and sum order: same bits)."""
    if columns and (norm or joined):
        raise ValueError("the column split does not norm or join its rows")
    lines = [
        "  const T* w = nullptr;",
        "  T* y = nullptr;",
        "  int N = 0;",
        "  int blk = blockIdx.x;",
    ]
    for i in range(groups):
        lines.append("  if (w == nullptr) {")
        lines.append(f"    const int nb{i} = w{i}_shape[0] / (8 * NB * CW);")
        lines.append(f"    if (blk < nb{i}) {{ w = w{i}; y = y{i}; N = w{i}_shape[0]; }}")
        lines.append(f"    else blk -= nb{i};")
        lines.append("  }")
    lines.append("  const int n0 = blk * (8 * NB * CW);")
    if joined:
        body = _k_split_body(_LOAD_W, norm, joined=True)
        return _ROWS + _JOINED_ROWS + "\n".join(lines) + "\n" + _STORE + body
    body = _BODY_COLUMNS if columns else _BODY_NORMED if norm else _BODY
    return _ROWS + "\n".join(lines) + "\n" + _STORE + body


# The MLP's gate and up products with SwiGLU in the launch: ``silu(x @ wg.T) * (x @ wu.T)``
# as mlx-lm's compiled ``swiglu`` (``gate * sigmoid(gate) * up``) computes it from the two
# products' rounded outputs, each intermediate rounded to T as MLX's CUDA elementwise kernel
# stores it (``hf2q_sigmoid`` from the Gated-DeltaNet kernel's header), so the bits of
# ``swiglu(*grouped_matmul_cuda(x, [wg, wu]))`` in one launch: one graph node less a layer and
# the two products' outputs never written. A block's NB column blocks are NB / 2 of the gate's
# and the same NB / 2 of the up's, so each output's two sums meet in one thread; the chunks,
# lanes, mma steps and warps' sum are _BODY's (same m-tiles and warps as the grouped launch,
# which depend on the rows and K only), so both sums have the grouped launch's bits.
_LOAD_W_SWIGLU = _LOAD_W_ROWS.replace(
    "@W_ROW@",
    "(nb < NB / 2 ? wg + (size_t)(n0 + nb * 8 + g) * K"
    " : wu + (size_t)(n0 + (nb - NB / 2) * 8 + g) * K)",
)
_SWIGLU_STORE = r"""
  constexpr int SLOTS = MT * NB * 4;
  constexpr int HALF = NB / 2;
  auto act = [&](size_t i, float gs, float us) {
    const float gq = hf2q_round<T>(gs);
    const float uq = hf2q_round<T>(us);
    const float sl = hf2q_round<T>(gq * hf2q_sigmoid<T>(gq));
    y[i] = hf2q_to<T>(sl * uq);
  };
  if (WARPS == 1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < HALF; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = mt * 16 + g + (e >= 2 ? 8 : 0);
          const int col = n0 + nb * 8 + 2 * t + (e & 1);
          if (row < M) act((size_t)row * N + col, acc[mt][nb][e], acc[mt][nb + HALF][e]);
        }
    return;
  }
"""
_SWIGLU_SUM = r"""
  for (int i = threadIdx.x; i < MT * HALF * 4 * 32; i += WARPS * 32) {
    const int q = i / 32;
    const int ln = i % 32;
    const int mt = q / (HALF * 4);
    const int nb = (q / 4) % HALF;
    const int e = q % 4;
    const int row = mt * 16 + (ln >> 2) + (e >= 2 ? 8 : 0);
    if (row >= M) continue;
    const int sg = (mt * NB + nb) * 4 + e;
    float gs = 0.0f;
    float us = 0.0f;
#pragma unroll
    for (int ww = 0; ww < WARPS; ++ww) {
      gs += red[ww][sg][ln];
      us += red[ww][sg + HALF * 4][ln];
    }
    act((size_t)row * N + n0 + nb * 8 + 2 * (ln & 3) + (e & 1), gs, us);
  }
"""


def _swiglu_source(norm: bool) -> str:
    """The SwiGLU launch's body (its rows normed in the launch with ``norm``)."""
    return (
        _ROWS
        + r"""
  const int N = wg_shape[0];
  const int n0 = blockIdx.x * (4 * NB);
"""
        + _normed(_BODY_LOOP_MARKED, norm).replace("@LOAD_W@\n", _LOAD_W_SWIGLU[1:])
        + _SWIGLU_STORE
        + _STAGE_PARTIALS[1:]
        + _SWIGLU_SUM[1:]
    )


_SOURCE_SWIGLU = _swiglu_source(False)
_SOURCE_NORMED = _ROWS + _SINGLE + _STORE + _BODY_NORMED
#: Most values a row normed in the launch may have: MLX 0.32.4's ``rms_norm_small`` (one block
#: a row, at most 8 vectors of 8 values a thread) takes 16-bit rows up to here; longer rows are
#: summed by another kernel in another order.
NORM_MAX_K = 8192


#: The MLX versions whose CUDA ``rms_norm_small`` sums a row in the order the normed launches
#: follow (0.32.1 rewrote it; 0.32.4 is what the lent GPUs run). Under another version a launch
#: could round a value differently from MLX's norm, and a verify whose rows take MLX's norm while
#: its plain steps take the launch's (past ``HF2Q_NORM_MM_ROWS``) would no longer be lossless.
NORM_ORDER_MLX = ("0.32.1", "0.32.2", "0.32.3", "0.32.4")


def norm_order_known() -> bool:
    """Whether the installed MLX sums its norms in the order the normed launches follow
    (:data:`NORM_ORDER_MLX`)."""
    return mx.__version__.split(".dev")[0].split("+")[0] in NORM_ORDER_MLX


def norm_source(source: str, eps: float) -> str:
    """A normed launch's body (``source``) for one ``eps``: a float32 constant of the source, as
    MLX passes its norm kernel the module's eps."""
    return f"  constexpr float EPS = {cuda_norm._float_literal(eps)};\n" + source


def norm_header() -> str:
    """The normed launches' header: the products', the 16-bit conversions MLX's kernels round
    with (the Gated-DeltaNet kernel's header) and :data:`_NORM_HEADER`."""
    return _swiglu_header() + _NORM_HEADER


@cache
def _norm_kernel(kind: str, eps: float) -> Any:
    """The normed launch of ``kind``: ``"single"``, ``"swiglu"``, ``"grouped<n>"`` or
    ``"joined<n>"`` (:func:`joined_matmul_cuda`)."""
    if kind == "single":
        names, outs, source = ["x", "w"], ["y"], _SOURCE_NORMED
    elif kind == "swiglu":
        names, outs, source = ["x", "wg", "wu"], ["y"], _swiglu_source(True)
    elif kind.startswith("joined"):
        n = int(kind.removeprefix("joined"))
        names = ["x", "c", *(f"w{i}" for i in range(n))]
        outs, source = [f"y{i}" for i in range(n)], grouped_source(n, norm=True, joined=True)
    else:
        n = int(kind.removeprefix("grouped"))
        names = ["x", *(f"w{i}" for i in range(n))]
        outs, source = [f"y{i}" for i in range(n)], grouped_source(n, norm=True)
    return mx.fast.cuda_kernel(
        name=cuda_norm.kernel_name(f"hf2q_norm_{kind}_mm", eps),
        input_names=[*names, "nw"],
        output_names=outs,
        source=norm_source(source, eps),
        header=norm_header(),
    )


def norm_supported(x: mx.array, weight: mx.array) -> str | None:
    """Why a launch cannot norm ``x``'s rows with an RMS norm of weight ``weight`` as MLX does
    (None when it can): the weight of x's dtype and shape (K,), K at most :data:`NORM_MAX_K`."""
    K = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (K,):
        return f"a norm weight {weight.shape} {weight.dtype} for rows of {K} {x.dtype}"
    if K > NORM_MAX_K:
        return f"rows of {K} values (MLX sums rows over {NORM_MAX_K} in another order)"
    return None


def _norm_inputs(x: mx.array, norm: tuple[mx.array, float]) -> tuple[mx.array, float]:
    weight, eps = norm
    why = norm_supported(x, weight)
    if why is not None:
        raise ValueError(f"the launch cannot norm {why}")
    return weight, float(eps)


@cache
def _kernel(columns: bool = False) -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_small_mm_cols" if columns else "hf2q_small_mm",
        input_names=["x", "w"],
        output_names=["y"],
        source=_SOURCE_COLUMNS if columns else _SOURCE,
        header=_HEADER,
    )


@cache
def _add_kernel(columns: bool = False) -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_small_mm_add_cols" if columns else "hf2q_small_mm_add",
        input_names=["x", "w", "r"],
        output_names=["y"],
        source=_SOURCE_ADD_COLUMNS if columns else _SOURCE_ADD,
        header=_HEADER,
    )


@cache
def _grouped_kernel(groups: int, columns: bool = False) -> Any:
    return mx.fast.cuda_kernel(
        name=f"hf2q_grouped_mm{groups}" + ("_cols" if columns else ""),
        input_names=["x", *(f"w{i}" for i in range(groups))],
        output_names=[f"y{i}" for i in range(groups)],
        source=grouped_source(groups, columns),
        header=_HEADER,
    )


def supported(x: mx.array, w: mx.array) -> str | None:
    """Why :func:`small_matmul_cuda` cannot compute ``x @ w.T`` (None when it can)."""
    if x.dtype not in (mx.bfloat16, mx.float16) or w.dtype != x.dtype:
        return f"dtypes {x.dtype}/{w.dtype} (needs bf16 or fp16, both the same)"
    if w.ndim != 2 or x.shape[-1] != w.shape[1]:
        return f"shapes {x.shape} x {w.shape}.T do not multiply"
    return _shape_supported(x, w.shape[1], w.shape[0])


def _shape_supported(x: mx.array, K: int, N: int) -> str | None:
    """Why the kernel's layout cannot take ``x``'s rows times a (N, K) weight (None when it can)."""
    if K == 0 or K % K_CHUNK:
        return f"K={K} is not a positive multiple of {K_CHUNK}"
    if N % 8:
        return f"N={N} is not a multiple of 8"
    rows = math.prod(x.shape[:-1])
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (1 to {MAX_ROWS})"
    return None


def launch_shape(rows: int, K: int, N: int) -> tuple[int, int, int, int]:
    """(m-tiles, 8-column blocks per thread block, warps, chunk-loop unrolling) for this product."""
    mt = -(-rows // 16)
    # At one m-tile, wider blocks (fewer, reusing each input load for more columns) only while
    # there are still at least 264 blocks: two per SM of an H200's 132. With more m-tiles the
    # inputs' loads outweigh the weight's: more column blocks per input load, even with as few
    # as 40 blocks (2560 columns at two m-tiles, below). Session 16, 64 rows of the 4B shapes:
    # four blocks, chunk loop unrolled 4 times, 21-41 us a product against 30-61 us for one
    # block, cuBLAS 24-56 us. Two and three m-tiles take eight blocks (session 21, the
    # launches timed in turn, us a product, 2560 x 9216 / 9216 x 2560 / 2560 x 2560: at 32 rows,
    # unrolled 4 times, 29.7 / 27.2 / 16.2 against 34.2 / 37.7 / 18.8 for two blocks unrolled
    # once, cuBLAS 40.1 / 48.0 / 30.2; at 48 rows, unrolled once, 35.1 / 29.2 / 18.5 against
    # 41.3 / 38.7 / 20.7 for four blocks unrolled 4 times). At four m-tiles no launch tried beats
    # four blocks unrolled 4 times by more than 3% (97.2 us for the three), and in the 4-slot
    # round (H100, session 57, plain_ab.py alternating in one process, same tokens) narrower
    # blocks lost though they take fewer registers (nvcc: 254 at four blocks, one 8-warp block an
    # SM; 130-148 at two, 78-80 at one): 8.56 ms a round against 10.28 for one block unrolled
    # once on a fast host, and on a slow one 10.04 against 10.49 (one block), 11.33 (two) and
    # 12.83 (two, unrolled 4 times); the chained tune (node_cost.py --chain) ranked them the
    # same way. Five m-tiles or more
    # take four blocks, unrolled once (session 20, at 96 rows 2560 x 9216 46.4 against 115.0
    # with two blocks, 9216 x 2560 45.1 against 121.4, 2560 x 2560 18.0 against 28.9; at 128
    # rows 49.6 / 53.5 / 21.6 against 75.8 / 68.7 / 27.4, cuBLAS 46.6 / 49.6 / 23.5; session 19,
    # the tied 2560 x 248320 head at 128 rows: 1069 against 1563). 242 registers at eight
    # m-tiles, no spills.
    unroll = 1
    if mt == 2 and N % 64 == 0:
        nb, unroll = 8, 4
    elif mt == 3 and N % 64 == 0:
        nb = 8
    elif 3 <= mt <= 4 and N % 32 == 0:
        nb, unroll = 4, 4
    elif mt >= 5 and N % 32 == 0:
        nb = 4
    elif mt >= 5 and N % 16 == 0:
        nb = 2
    elif mt == 1 and N % 32 == 0 and N >= 32 * 264:
        nb = 4
    else:
        nb = 2 if mt <= 2 and N % 16 == 0 else 1
    # The warps split K and fix the order of the sum: they depend on K only, so that a row's bits
    # do not depend on how many rows a launch computes.
    chunks = K // K_CHUNK
    warps = 1
    for cand in (8, 4, 2):
        if chunks >= 2 * cand:
            warps = cand
            break
    return mt, nb, warps, unroll


#: Column-split layout (:data:`_BODY_COLUMNS`): warps of a thread block, and the fewest thread
#: blocks a launch must have for the layout to be used. In the graph of a 4-slot verify of the
#: 4B-shaped pair on the H200 (session 26, kernel traces, medians) the tied head's launch (1940
#: blocks of 128 columns) took 458 us against the K-split's 579, but the MLP's gate/up (one
#: grouped launch, 144 blocks) 60.4 us against 52.4: few blocks of 256 threads do not keep the
#: weight stream as busy as the K-split's 576. So in practice: heads.
COLUMN_WARPS = 8
COLUMN_MIN_BLOCKS = 1024
#: M-tiles the column split is used at. Below, the inputs are a small share of what the K-split
#: layout's blocks read; above, its 166 registers (two 8-column blocks a warp at eight m-tiles)
#: leave one block an SM. On the H200 (session 26, ``node_cost.py --tune``, us a product, column
#: split / K-split / cuBLAS): the 2560 x 248320 head 515 / 581 / 515 at 48 rows, 571 / 704 / 472
#: at 64, 986 / 1007 / 452 at 128 (one 8-column block a warp: 1760); 2560 x 9216 30.5 / 32.2 /
#: 37.0 at 48, 33.5 / 37.6 / 35.2 at 64, 50.4 / 50.2 / 36.7 at 128. Narrower splits for every
#: 64-row product lost too (H100, session 56): 2 or 4 warps timed gate/up alone at 35.7 us
#: against 41.2, but in the 4-slot round (plain_ab.py, same tokens) the round went from 8.50 ms
#: to 13.67 (2 warps) and 15.11 (4): the 2560-wide products' 20-40 blocks took 144 us a launch
#: against 32, and gate/up 61.8 against 57.6.
COLUMN_MT = (3, 4)


def column_shape(
    rows: int, K: int, N: int, total: int | None = None
) -> tuple[int, int, int] | None:
    """(8-column blocks per warp, warps, chunks loaded ahead) of the column-split layout
    for this product, or None where it is not used: m-tiles other than :data:`COLUMN_MT`, a K the
    K-split computes with one warp (its bits are its accumulators, no sum; see
    :data:`_BODY_COLUMNS`), N not a multiple of a block's columns, or fewer thread blocks than
    :data:`COLUMN_MIN_BLOCKS` in the launch (``total``: the columns of the whole launch, a grouped
    one's weights together; default N). Under ``HF2Q_MM_COLS64`` (:func:`cols64`) launches of four
    m-tiles and at least :data:`COLS64_MIN_COLUMNS` columns take its layout instead. Same bits as
    :func:`launch_shape`'s layout wherever it is used."""
    mt, _, warps, _ = launch_shape(rows, K, N)
    if mt not in COLUMN_MT or warps == 1:
        return None
    if mt == 4 and (forced := cols64()) is not None and (total or N) >= COLS64_MIN_COLUMNS:
        nb, cw, _ = forced
        return None if N % (8 * nb * cw) else forced
    nb = 2
    width = 8 * nb * COLUMN_WARPS
    if N % width or (total or N) // width < COLUMN_MIN_BLOCKS:
        return None
    return nb, COLUMN_WARPS, 1


def _template(
    dtype: Any, mt: int, nb: int, warps: int, unroll: int, cw: int = 1, depth: int = 1
) -> list:
    """The kernels' template arguments (see the sources' comment; ``cw``: the column-split
    layout's warps, 1 for the K-split; ``depth``: the column split's chunks loaded ahead)."""
    args = [("T", dtype), ("MT", mt), ("NB", nb), ("WARPS", warps), ("U", unroll), ("CW", cw)]
    return args + [("D", depth)] if cw > 1 else args


def shared_bytes(mt: int, nb: int, warps: int, cw: int = 1, depth: int = 1) -> int:
    """Static shared memory of a launch: the warps' partial sums (float32, 4 per m-tile and
    column block, per lane and warp); with the column split (``cw`` > 1) the staged chunks of x
    instead (two, or ``depth`` + 2 loaded ``depth`` ahead; ``mt * 16`` rows of 72 elements, two
    bytes each) and each warp's running sums (as nvcc counts them: 62464 bytes for four m-tiles,
    two column blocks, 4 warps, 3 ahead)."""
    if cw > 1:
        staged = 2 if depth == 1 else depth + 2
        return staged * mt * 16 * 72 * 2 + cw * mt * nb * 4 * 32 * 4
    return warps * mt * nb * 4 * 32 * 4


#: (column blocks, unrolling) of a single weight's product at one m-tile where four column
#: blocks would give fewer than 264 thread blocks (N < 8448: the 2560-wide outputs of the 4B
#: shapes, the down and output projections), with ``HF2Q_MM_NARROW=1``. Off by default: on the
#: H200 (session 39, ``kernel_trace.py``: device time from a kernel trace, each launch by itself,
#: us a product with its residual add, 9216 x 2560 / 4096 x 2560) it took 16.2 / 8.5 at one row
#: and 17.1 / 9.0 at 16 rows against 19.3 / 9.6 and 20.5 / 10.2 for :func:`launch_shape`'s two
#: column blocks unrolled once, but the one decoding run with it on by default (run 4, another
#: machine) was slower exactly where it applies (one-row plain steps +1.0-1.3 ms, one-slot rounds
#: +3 ms) and not where it does not (4- and 8-slot rounds): unsettled until a same-process A/B
#: (``plain_ab.py --env HF2Q_MM_NARROW --values 0,1``). Same bits either way (column blocks and
#: unrolling do not change a row's sums). Grouped and dequantizing launches never take it.
ONE_TILE_NARROW = (1, 2)
#: HF2Q_MM_NARROW=1: :data:`ONE_TILE_NARROW`'s launch there, for A/B runs.
NARROW_ENV = "HF2Q_MM_NARROW"


#: HF2Q_MM_COLS64="NBxCWxD": launches of four m-tiles (49-64 rows) with at least
#: :data:`COLS64_MIN_COLUMNS` columns (the MLP's gate and up grouped, 18432 on the 4B shapes; the
#: head; the attention's q/k/v) take the column split with NB 8-column blocks a warp, CW warps and
#: the weights and x loaded D chunks ahead, for in-round A/B runs (``plain_ab.py --slots 4
#: --values HF2Q_MM_COLS64=0,HF2Q_MM_COLS64=2x4x3``); off by default, the same bits. Why: at 64
#: rows the K-split's blocks each read all 64 rows of x from L2, twice the weight's bytes for
#: gate and up at four column blocks (about 282 MB in 57 us a launch on an H100, session 57's
#: 4-slot trace), where the column split reads x once per block of 64-128 columns. It lost with
#: one chunk in flight (session 26: gate/up 60.4 against 52.4 us), and again with the weights 3
#: chunks ahead but x one (session 57, H100, same tokens: the 4-slot round 9.16 ms off against
#: 10.33 / 10.47 / 10.49 at 2x4x3 / 1x8x3 / 2x8x2; gate/up 88.7 us a launch), and with x copied
#: ahead too (cp.async; session 58, H200, same tokens: 7.974 ms off against 8.410 at 2x4x3).
COLS64_ENV = "HF2Q_MM_COLS64"
#: Fewest columns (all of a launch's weights) a launch needs for ``HF2Q_MM_COLS64``'s layout: the
#: 2560-wide products would have 10-40 blocks.
COLS64_MIN_COLUMNS = 8192


def cols64() -> tuple[int, int, int] | None:
    """``HF2Q_MM_COLS64``'s (column blocks a warp, warps, chunks ahead), None when unset or 0; a
    malformed value is an error naming the setting."""
    raw = os.environ.get(COLS64_ENV, "").strip().lower()
    if raw in ("", "0"):
        return None
    parts = [p.strip() for p in raw.split("x")]
    if (
        len(parts) == 3
        and parts[0] in ("1", "2", "4")
        and parts[1] in ("2", "4", "8")
        and parts[2] in ("1", "2", "3")
    ):
        return int(parts[0]), int(parts[1]), int(parts[2])
    raise UsageError(
        f"{COLS64_ENV}={raw!r} must be NBxCWxD with NB 1, 2 or 4, CW 2, 4 or 8 and D 1, 2 or 3 "
        "(e.g. 2x4x3): unset it or fix it"
    )


def narrow_enabled() -> bool:
    """Whether ``HF2Q_MM_NARROW=1`` asks for :data:`ONE_TILE_NARROW` (unset or 0: no)."""
    from hf2q.kernels import select  # (select imports this module)

    return select._flag(NARROW_ENV, "0")


def _layout(
    rows: int, K: int, N: int, tune: tuple[int, ...] | None, columns: bool
) -> tuple[int, int, int, int, int, int]:
    """(m-tiles, column blocks, warps, unrolling, column-split warps or 1, chunks ahead) of a
    launch."""
    mt, nb, warps, unroll = launch_shape(rows, K, N)
    if mt == 1 and N % 32 == 0 and N < 32 * 264 and narrow_enabled():
        nb, unroll = ONE_TILE_NARROW
    cw = depth = 1
    if tune is not None:
        if len(tune) not in (3, 4, 5):
            raise ValueError(
                f"tune {tune}: (column blocks, warps, unrolling[, column warps[, chunks ahead]])"
            )
        nb, warps, unroll = tune[:3]
        cw = tune[3] if len(tune) >= 4 else 1
        depth = tune[4] if len(tune) == 5 else 1
        smem = shared_bytes(mt, nb, warps, cw, depth)
        if smem > SHARED_BYTES:
            raise ValueError(f"tune {tune}: {smem} bytes of shared memory (at most {SHARED_BYTES})")
        if cw > 1 and warps == 1:
            raise ValueError(f"tune {tune}: the column split needs warps > 1")
        if not 1 <= depth <= 3 or (depth > 1 and cw == 1):
            raise ValueError(f"tune {tune}: 1 to 3 chunks ahead, more than 1 with the column split")
    elif columns and (shape := column_shape(rows, K, N)) is not None:
        nb, cw, depth = shape
    return mt, nb, warps, unroll, cw, depth


def small_matmul_cuda(
    x: mx.array,
    w: mx.array,
    *,
    tune: tuple[int, ...] | None = None,
    add: mx.array | None = None,
    columns: bool = False,
    norm: tuple[mx.array, float] | None = None,
) -> mx.array:
    """``x @ w.T`` in one tensor-core launch; see :func:`supported` for what it takes.

    ``tune`` overrides :func:`launch_shape`'s (column blocks, warps, unrolling), for tuning, a
    fourth value picks the column split with that many warps and a fifth how many chunks of
    weights and x it loads ahead (1-3): every choice computes the same
    values up to float32 summation order (a row's bits are the same across row counts, column
    blocks, unrolling and layouts for one choice of ``warps``). ``add``: an array of the output's
    shape and dtype added in the same launch (``x @ w.T + add`` with the bits of the two steps).
    ``columns``: use the column-split layout where :func:`column_shape` says (same bits).
    ``norm``: (weight, eps) of an RMS norm the launch applies to ``x``'s rows first (the bits of
    ``mx.fast.rms_norm(x, weight, eps) @ w.T``; :func:`norm_supported`; not with ``add`` or
    ``tune``; the K-split layout).
    """
    K, N = w.shape[1], w.shape[0]
    rows = math.prod(x.shape[:-1])
    if norm is not None:
        if add is not None or tune is not None:
            raise ValueError("a normed launch takes no addend and no tune")
        nw, eps = _norm_inputs(x, norm)
        columns = False
    mt, nb, warps, unroll, cw, depth = _layout(rows, K, N, tune, columns)
    if add is not None and (add.shape != (*x.shape[:-1], N) or add.dtype != x.dtype):
        raise ValueError(
            f"addend {add.shape} {add.dtype} is not the output's {x.shape[:-1]}+({N},)"
        )
    split = cw > 1
    if norm is not None:
        kernel, inputs = _norm_kernel("single", eps), [x, w, nw]
    elif add is None:
        kernel, inputs = _kernel(split), [x, w]
    else:
        kernel, inputs = _add_kernel(split), [x, w, add]
    (y,) = kernel(
        inputs=inputs,
        template=_template(x.dtype, mt, nb, warps, unroll, cw, depth),
        grid=((N // (8 * nb * cw)) * 32 * (cw if split else warps), 1, 1),
        threadgroup=(32 * (cw if split else warps), 1, 1),
        output_shapes=[(*x.shape[:-1], N)],
        output_dtypes=[x.dtype],
    )
    return y


# Quantized weights in MLX's affine layout (``mx.quantize``): ``w`` uint32 (N, K * BITS / 32),
# each word holding 32 / BITS values of consecutive k, the lowest-indexed in the lowest bits;
# ``s`` and ``b`` (N, K / GS) of T, the value being ``s * q + b``. Each lane dequantizes the 16
# weights of its column it would have loaded (one group: 16 divides GS), as fmaf(s, q, b) in
# float32 rounded once to T, into the very registers _BODY's unquantized weights fill; the mma
# steps, the chunk order and the warps' sum are _BODY's. So, as there, a row's bits do not
# depend on the other rows or on how many there are: a verify row and the decode step it stands
# for agree bit for bit, which MLX's own quantized product does not give on CUDA (MLX 0.32:
# a matrix-vector kernel below 8 rows, a CUTLASS GEMM above; benchmarks/quant_rows.py).
_LOAD_WQ = r"""
    unsigned wv[NB][8];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int col = n0 + nb * 8 + g;
      const size_t gi = (size_t)col * (K / GS) + kb / GS;
      const float sc = Hf2qDeq<T>::from(s[gi]);
      const float bi = Hf2qDeq<T>::from(b[gi]);
      unsigned q[4];
      if (BITS == 4) {
        const uint2 p = *reinterpret_cast<const uint2*>(w + (size_t)col * (K / 8) + kb / 8);
        q[0] = p.x; q[1] = p.y; q[2] = 0u; q[3] = 0u;
      } else {
        const uint4 p = *reinterpret_cast<const uint4*>(w + (size_t)col * (K / 4) + kb / 4);
        q[0] = p.x; q[1] = p.y; q[2] = p.z; q[3] = p.w;
      }
      constexpr int PER = 32 / BITS;
      constexpr unsigned MASK = (1u << BITS) - 1u;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float v0 = (float)((q[(2 * i) / PER] >> (BITS * ((2 * i) % PER))) & MASK);
        const float v1 = (float)((q[(2 * i + 1) / PER] >> (BITS * ((2 * i + 1) % PER))) & MASK);
        wv[nb][i] = Hf2qDeq<T>::pack(fmaf(sc, v0, bi), fmaf(sc, v1, bi));
      }
    }
"""
_QBODY = _k_split_body(_LOAD_WQ)

_QHEADER = (
    _HEADER
    + r"""
// A T value as float, and two float values rounded to T (as Hf2qMma<T>::to rounds) packed as an
// mma operand register (the lower-indexed value in the low half).
template <typename T> struct Hf2qDeq {
  static __device__ __forceinline__ float from(T v);
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const T a = Hf2qMma<T>::to(lo);
    const T c = Hf2qMma<T>::to(hi);
    return (unsigned)*reinterpret_cast<const unsigned short*>(&a) |
           ((unsigned)*reinterpret_cast<const unsigned short*>(&c) << 16);
  }
};
template <> __device__ __forceinline__ float Hf2qDeq<__nv_bfloat16>::from(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float Hf2qDeq<__half>::from(__half v) {
  return __half2float(v);
}
"""
)
_QSOURCE = _ROWS + _SINGLE + _STORE + _QBODY
_QSOURCE_ADD = _ROWS + _SINGLE + _STORE_ADD + _QBODY

#: HF2Q_QMM_LAUNCH=NBxWARPSxU (e.g. ``8x8x2``): the dequantizing kernel's launch instead of
#: :func:`launch_shape`'s, for tuning on a GPU (``benchmarks/quant_rows.py --tune``,
#: ``plain_ab.py``): those column blocks and unrolling up to two m-tiles (halved where shared
#: memory or N ask), :func:`launch_shape`'s above (session 34: 8 column blocks at 64 rows, a
#: prefill chunk, asked more registers than a launch has), the warps at every row count. Rows
#: keep their bits across row counts for one setting; the warps change them.
QMM_LAUNCH_ENV = "HF2Q_QMM_LAUNCH"


def _env_launch(rows: int, N: int) -> tuple[int, int, int] | None:
    raw = os.environ.get(QMM_LAUNCH_ENV, "").strip()
    if not raw:
        return None
    try:
        nb, warps, unroll = (int(v) for v in raw.lower().split("x"))
    except ValueError:
        raise UsageError(
            f"{QMM_LAUNCH_ENV}={raw!r} must be NBxWARPSxUNROLL, e.g. 8x8x2: unset it or fix it"
        ) from None
    if not 1 <= warps <= 8:  # (512 threads with the accumulators of many rows do not launch)
        raise UsageError(f"{QMM_LAUNCH_ENV}={raw!r} must ask for 1 to 8 warps: unset it or fix it")
    mt = -(-rows // 16)
    if mt > 2:  # many rows: the default launch's blocks (they depend on rows and N only)
        _, nb, _, unroll = launch_shape(rows, K_CHUNK, N)
    while nb > 1 and (shared_bytes(mt, nb, warps) > SHARED_BYTES or N % (8 * nb)):
        nb //= 2
    return nb, warps, unroll


#: Bits and group sizes of MLX's affine quantization the kernel dequantizes.
Q_BITS = (4, 8)
Q_GROUPS = (32, 64, 128)


@cache
def _qkernel(add: bool = False) -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_small_qmm_add" if add else "hf2q_small_qmm",
        input_names=["x", "w", "s", "b", "r"] if add else ["x", "w", "s", "b"],
        output_names=["y"],
        source=_QSOURCE_ADD if add else _QSOURCE,
        header=_QHEADER,
    )


def quantized_supported(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, bits: int, group: int
) -> str | None:
    """Why :func:`small_qmatmul_cuda` cannot compute ``x @ dequantize(w, scales, biases).T``
    (None when it can)."""
    if x.dtype not in (mx.bfloat16, mx.float16):
        return f"dtype {x.dtype} (needs bf16 or fp16)"
    if biases is None or scales.dtype != x.dtype or biases.dtype != x.dtype:
        return "scales and biases of the input's dtype needed (affine quantization)"
    if bits not in Q_BITS or group not in Q_GROUPS:
        return f"{bits}-bit groups of {group} (needs bits in {Q_BITS}, groups in {Q_GROUPS})"
    if w.dtype != mx.uint32 or w.ndim != 2:
        return f"packed weight {w.dtype} {w.shape} (needs a 2-D uint32 array)"
    N, K = w.shape[0], w.shape[1] * 32 // bits
    if x.shape[-1] != K:
        return f"shapes {x.shape} x ({N}, {K}).T do not multiply"
    if scales.shape != (N, K // group) or biases.shape != scales.shape:
        return f"scales {scales.shape} / biases {biases.shape} are not ({N}, {K // group})"
    return _shape_supported(x, K, N)


def small_qmatmul_cuda(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    bits: int,
    group: int,
    add: mx.array | None = None,
    tune: tuple[int, int, int] | None = None,
) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` (MLX's affine layout, ``nn.QuantizedLinear``'s
    weights) in one tensor-core launch, each weight dequantized in float32 and rounded once to
    the input's dtype; see :func:`quantized_supported` for what it takes. Same launch layout as
    :func:`small_matmul_cuda`'s K-split, so a row's bits do not depend on the row count.
    ``add``: an array of the output's shape and dtype added in the same launch. ``tune``:
    (column blocks, warps, unrolling) instead of :func:`launch_shape`'s, for tuning (a row's
    bits depend on ``warps`` only)."""
    N, K = w.shape[0], w.shape[1] * 32 // bits
    rows = math.prod(x.shape[:-1])
    mt, nb, warps, unroll = launch_shape(rows, K, N)
    tune = _env_launch(rows, N) if tune is None else tune
    if tune is not None:
        nb, warps, unroll = tune
        if shared_bytes(mt, nb, warps) > SHARED_BYTES or N % (8 * nb):
            raise ValueError(f"tune {tune}: does not fit {rows} rows x {N} columns")
    if add is not None and (add.shape != (*x.shape[:-1], N) or add.dtype != x.dtype):
        raise ValueError(
            f"addend {add.shape} {add.dtype} is not the output's {x.shape[:-1]}+({N},)"
        )
    template = _template(x.dtype, mt, nb, warps, unroll) + [("BITS", bits), ("GS", group)]
    (y,) = _qkernel(add is not None)(
        inputs=[x, w, scales, biases] if add is None else [x, w, scales, biases, add],
        template=template,
        grid=((N // (8 * nb)) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*x.shape[:-1], N)],
        output_dtypes=[x.dtype],
    )
    return y


#: Most weights one grouped launch takes (a Gated-DeltaNet layer's four input projections).
MAX_GROUPS = 4


def grouped_supported(x: mx.array, ws: list[mx.array]) -> str | None:
    """Why :func:`grouped_matmul_cuda` cannot compute ``[x @ w.T for w in ws]`` (None when it can)."""
    if not 2 <= len(ws) <= MAX_GROUPS:
        return f"{len(ws)} weights (2 to {MAX_GROUPS})"
    for w in ws:
        why = supported(x, w)
        if why is not None:
            return why
    return None


def grouped_matmul_cuda(
    x: mx.array,
    ws: list[mx.array],
    *,
    columns: bool = False,
    norm: tuple[mx.array, float] | None = None,
    context: mx.array | None = None,
) -> list[mx.array]:
    """``[x @ w.T for w in ws]`` in one launch (weights of one K; see :func:`grouped_supported`).

    Each output has the same bits as :func:`small_matmul_cuda` of its weight alone: the launch
    uses the same m-tiles and warps (both depend on the rows and K only) and a column-block
    width every weight's N takes, which only decides which thread block computes a column.
    One graph node and one launch where the separate products make one each: for a decoding
    step that is most of its launches (a layer's q/k/v or four Gated-DeltaNet input projections,
    the MLP's gate and up), and the smallest of them (two 32-column gate projections a layer on
    Qwen3.5-4B) cost a launch each for almost no work. ``columns``: the column-split layout
    where :func:`column_shape` takes every weight (same bits). ``norm``: (weight, eps) of an RMS
    norm applied to ``x``'s rows in the launch (as in :func:`small_matmul_cuda`; K-split).
    ``context`` (B, P, K), with ``norm``: each batch row's context rows before its rows of ``x``
    (B, L, K), as they come (:func:`joined_matmul_cuda`); outputs (B, P + L, N).
    """
    K = ws[0].shape[1]
    if context is None:
        lead = x.shape[:-1]
    else:
        why = joined_supported(context, x, ws)
        if why is not None or norm is None:
            raise ValueError(f"the joined launch cannot take {why or 'rows not normed'}")
        lead = (context.shape[0], context.shape[1] + x.shape[1])
    rows = math.prod(lead)
    # The narrowest weight's launch (fewest column blocks) sets the width and the unrolling;
    # m-tiles and warps depend on the rows and K only.
    mt, nb, warps, unroll = min((launch_shape(rows, K, w.shape[0]) for w in ws), key=lambda s: s[1])
    if context is not None:
        unroll = 1  # (the row lookups' registers: at two m-tiles, unrolled 4 times, nvcc spills)
    cw = depth = 1
    total = sum(w.shape[0] for w in ws)
    split_ok = columns and norm is None
    shapes = [column_shape(rows, K, w.shape[0], total) for w in ws] if split_ok else [None]
    if all(sh is not None and sh == shapes[0] for sh in shapes):
        nb, cw, depth = shapes[0]
    split = cw > 1
    blocks = sum(w.shape[0] // (8 * nb * cw) for w in ws)
    if norm is None:
        kernel, inputs = _grouped_kernel(len(ws), split), [x, *ws]
    else:
        nw, eps = _norm_inputs(x, norm)
        if context is None:
            kernel, inputs = _norm_kernel(f"grouped{len(ws)}", eps), [x, *ws, nw]
        else:
            kernel, inputs = _norm_kernel(f"joined{len(ws)}", eps), [x, context, *ws, nw]
    return kernel(
        inputs=inputs,
        template=_template(x.dtype, mt, nb, warps, unroll, cw, depth),
        grid=(blocks * 32 * (cw if split else warps), 1, 1),
        threadgroup=(32 * (cw if split else warps), 1, 1),
        output_shapes=[(*lead, w.shape[0]) for w in ws],
        output_dtypes=[x.dtype] * len(ws),
    )


def joined_supported(c: mx.array, x: mx.array, ws: list[mx.array]) -> str | None:
    """Why :func:`joined_matmul_cuda` cannot compute ``c`` then ``x``'s rows times each weight
    (None when it can)."""
    if c.ndim != 3 or x.ndim != 3 or c.shape[0] != x.shape[0] or c.shape[2] != x.shape[2]:
        return f"context {c.shape} and rows {x.shape} are not (B, P, K) and (B, L, K)"
    if c.dtype != x.dtype:
        return f"context {c.dtype} and rows {x.dtype}"
    if c.shape[1] == 0:
        return "no context rows"
    why = grouped_supported(x, ws)  # (dtypes, shapes, widths; the rows are checked next)
    if why is not None:
        return why
    rows = c.shape[0] * (c.shape[1] + x.shape[1])
    return None if rows <= MAX_ROWS else f"{rows} rows (1 to {MAX_ROWS})"


def joined_matmul_cuda(
    c: mx.array, x: mx.array, ws: list[mx.array], *, norm: tuple[mx.array, float]
) -> list[mx.array]:
    """``[concatenate([c, rms_norm(x)], axis=1) @ w.T for w in ws]`` in one launch, without the
    copy and without the norm's node: the grouped launch's products of each row (same bits as
    :func:`grouped_matmul_cuda` of the joined rows), x's rows normed in the launch as
    :func:`small_matmul_cuda`'s ``norm`` does. ``c`` (B, P, K), ``x`` (B, L, K); outputs
    (B, P + L, N) (:func:`joined_supported` says what it takes)."""
    return grouped_matmul_cuda(x, ws, norm=norm, context=c)


def _swiglu_header() -> str:
    """The products' header and the Gated-DeltaNet kernel's (its sigmoid and 16-bit roundings,
    as MLX's CUDA ops compute them)."""
    return _HEADER + cuda_gated_delta._HEADER


@cache
def _swiglu_kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_swiglu_mm",
        input_names=["x", "wg", "wu"],
        output_names=["y"],
        source=_SOURCE_SWIGLU,
        header=_swiglu_header(),
    )


def _swiglu_template(dtype: Any, mt: int, nb: int, warps: int, unroll: int) -> list:
    """The SwiGLU launch's template arguments: :func:`_template`'s less CW (no column split)."""
    return _template(dtype, mt, nb, warps, unroll)[:5]


def swiglu_shape(rows: int, K: int, N: int) -> tuple[int, int, int, int] | None:
    """(m-tiles, column blocks of both weights together, warps, unrolling) of
    :func:`swiglu_matmul_cuda`'s launch, or None where it does not take the product: the
    grouped launch's of the two weights (:func:`launch_shape`), whose column blocks are split
    half and half between them, so the same blocks a launch and the same registers; where that
    is one column block, None (the caller runs the grouped launch and the elementwise step)."""
    mt, nb, warps, unroll = launch_shape(rows, K, N)
    return None if nb < 2 else (mt, nb, warps, unroll)


def swiglu_supported(x: mx.array, wg: mx.array, wu: mx.array, columns: bool = False) -> str | None:
    """Why :func:`swiglu_matmul_cuda` cannot compute ``swiglu(x @ wg.T, x @ wu.T)`` (None when it
    can). ``columns``: the caller's grouped launch would use the column split where
    :func:`column_shape` takes both weights (the launch is a K-split; that layout, e.g.
    ``HF2Q_MM_COLS64``'s, is then left to the grouped launch)."""
    if wg.shape != wu.shape:
        return f"gate {wg.shape} and up {wu.shape} weights differ in shape"
    why = supported(x, wg) or supported(x, wu)
    if why is not None:
        return why
    rows, K, N = math.prod(x.shape[:-1]), wg.shape[1], wg.shape[0]
    if swiglu_shape(rows, K, N) is None:
        return f"N={N} takes one 8-column block a launch"
    if columns and column_shape(rows, K, N, 2 * N) is not None:
        return f"the column split takes {rows} rows of {N} + {N} columns"
    return None


def swiglu_matmul_cuda(
    x: mx.array, wg: mx.array, wu: mx.array, *, norm: tuple[mx.array, float] | None = None
) -> mx.array:
    """``silu(x @ wg.T) * (x @ wu.T)`` (mlx-lm's SwiGLU of the MLP's gate and up products) in
    one launch, with the bits of ``swiglu(*grouped_matmul_cuda(x, [wg, wu]))`` (see
    :data:`_SOURCE_SWIGLU`; :func:`swiglu_supported` says what it takes). ``norm``: (weight,
    eps) of an RMS norm applied to ``x``'s rows in the launch (as in :func:`small_matmul_cuda`)."""
    K, N = wg.shape[1], wg.shape[0]
    shape = swiglu_shape(math.prod(x.shape[:-1]), K, N)
    if shape is None:
        raise ValueError(swiglu_supported(x, wg, wu))
    mt, nb, warps, unroll = shape
    if norm is not None:
        nw, eps = _norm_inputs(x, norm)
        kernel, inputs = _norm_kernel("swiglu", eps), [x, wg, wu, nw]
    else:
        kernel, inputs = _swiglu_kernel(), [x, wg, wu]
    (y,) = kernel(
        inputs=inputs,
        template=_swiglu_template(x.dtype, mt, nb, warps, unroll),
        grid=((N // (4 * nb)) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(*x.shape[:-1], N)],
        output_dtypes=[x.dtype],
    )
    return y
