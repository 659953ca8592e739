"""Row-invariant attention over a KV cache for MLX's CUDA backend (bf16 / fp16).

What it does: ``row_attention_cuda(q, keys, values, offset, scale)`` computes causal scaled
dot-product attention of query row i of batch row b over the keys at positions
``0 .. offset[b] + i`` of that batch row (and only those), in one ``mx.fast.cuda_kernel`` launch,
and returns it as (B, L, n_q, D), the layout the output projection reads. The offsets are the
cache's own (its positions before the new rows), so no position or mask array is built: on a GPU
every extra graph node costs the host more than this kernel's work at decoding sizes.

Why: greedy DFlash is lossless when the verify computes every row exactly as plain decoding
computes that step. In half precision MLX's attention does not: one query runs its vector
kernel, 16 queries cuDNN, and the two round differently (``benchmarks/row_invariance.py`` on
the H200: the first attention layer is where verify rows and decode steps part; the layers
before it are already bit-equal). Here a query row's result depends only on that row's query,
its position and the keys it sees, never on how many rows are computed together, so a verify
block and the decode steps it stands for give the same bits. It also needs no mask array: the
visible keys follow from the position, and the whole cache buffer is read in place (no view,
no padding copy).

Layout of the work: one thread block of :func:`warps` warps per (batch row, query row, KV head)
computes that row for the KV head's group of query heads (GQA). Keys are cut into groups of 8 at
fixed absolute positions; group t goes to warp ``t % warps``. Lane l holds elements
``l*D/32 ..`` of every query head, key and value row (coalesced loads of whole rows), so a score
is a butterfly sum over the warp (every lane gets the same bits); each warp keeps a running
(max, sum, output) online-softmax state in float32, rescaled once per group, and accumulates
``p * v`` key by key. The warps' states are merged in warp order and rounded once to the output
dtype. Every order in this depends only on absolute key positions, the row's own limit and the
head sizes.

What it does not do: float32 (MLX's attention there agrees to rounding and the tokens are equal;
tested), quantized caches, attention sinks, masks other than causal (plus an optional sliding
window), head sizes that are not a multiple of 32, or more than :data:`MAX_GROUP` query heads per
KV head (:func:`supported` says which). One block per row and KV head: for one decode row over
a long context fewer SMs work than in MLX's split-key kernel.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

#: Warps per thread block where the merge buffer fits (see :func:`warps`).
WARPS = 8
#: Query heads per KV head the kernel keeps in registers.
MAX_GROUP = 8

_HEADER = r"""
// Element conversions, and loads of N consecutive elements (16 bytes at once where N = 8).
template <typename T> struct Hf2qAttnT;
template <> struct Hf2qAttnT<__nv_bfloat16> {
  static __device__ __forceinline__ float f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 to(float x) { return __float2bfloat16(x); }
  template <int N>
  static __device__ __forceinline__ void load(const __nv_bfloat16* p, float* out) {
    if constexpr (N == 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int u = 0; u < 8; ++u) out[u] = __bfloat162float(e[u]);
    } else {
#pragma unroll
      for (int u = 0; u < N; ++u) out[u] = __bfloat162float(p[u]);
    }
  }
};
template <> struct Hf2qAttnT<__half> {
  static __device__ __forceinline__ float f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half to(float x) { return __float2half(x); }
  template <int N>
  static __device__ __forceinline__ void load(const __half* p, float* out) {
    if constexpr (N == 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const __half* e = reinterpret_cast<const __half*>(&raw);
#pragma unroll
      for (int u = 0; u < 8; ++u) out[u] = __half2float(e[u]);
    } else {
#pragma unroll
      for (int u = 0; u < N; ++u) out[u] = __half2float(p[u]);
    }
  }
};
"""

# Template arguments: T (bf16/fp16), G (query heads per KV head), D (head size, a multiple of 32),
# WARPS, WINDOW (0: no sliding window). Inputs q (B, NQ, L, D), k/v (B, NKV, C, D) cache buffers,
# off (B,) or (1,) int32 position of each batch row's first query row, scale (1,) float32; output
# o (B, L, NQ, D).
_SOURCE = r"""
  constexpr int E = D / 32;  // elements of a key/value/query row per lane
  constexpr int KG = 8;      // keys per group: loads in flight, one softmax rescale per group
  const int NQ = q_shape[1];
  const int L = q_shape[2];
  const int NKV = k_shape[1];
  const int C = k_shape[2];
  const int blk = blockIdx.x;
  const int h = blk % NKV;
  const int i = (blk / NKV) % L;
  const int b = blk / (NKV * L);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int limit = off[off_shape[0] == 1 ? 0 : b] + i + 1;
  if (limit > C) limit = C;
  int start = 0;
  if (WINDOW > 0 && limit - WINDOW > 0) start = limit - WINDOW;
  __shared__ float sm[WARPS][G];
  __shared__ float sl[WARPS][G];
  __shared__ float sacc[WARPS][G][D];
  const float sc = scale[0];
  float qr[G][E], m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = q + (((size_t)b * NQ + h * G + g) * L + i) * D + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) qr[g][e] = Hf2qAttnT<T>::f(qp[e]) * sc;
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
  }
  const T* kb = k + ((size_t)b * NKV + h) * (size_t)C * D + lane * E;
  const T* vb = v + ((size_t)b * NKV + h) * (size_t)C * D + lane * E;
  if (limit > start) {
    const int g0 = start / KG;
    const int g1 = (limit - 1) / KG;
    const int first = g0 + (((warp - g0) % WARPS) + WARPS) % WARPS;
    for (int gi = first; gi <= g1; gi += WARPS) {
      const int j0 = gi * KG;
      float s[KG][G];
      // Scores: lane holds E elements of each key row (coalesced loads), a butterfly sums them.
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        float kf[E];
        const int j = j0 + kk;
        if (j >= start && j < limit) {
          Hf2qAttnT<T>::template load<E>(kb + (size_t)j * D, kf);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) kf[e] = 0.0f;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float part = 0.0f;
#pragma unroll
          for (int e = 0; e < E; ++e) part += qr[g][e] * kf[e];
          s[kk][g] = part;
        }
      }
#pragma unroll
      for (int kk = 0; kk < KG; ++kk)
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float x = s[kk][g];
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
          const int j = j0 + kk;
          s[kk][g] = (j >= start && j < limit) ? x : -INFINITY;
        }
      // Online softmax, once per group; every lane holds the same scores, hence the same state.
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float gmax = m[g];
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) gmax = fmaxf(gmax, s[kk][g]);
        const float alpha = expf(m[g] - gmax);
        float psum = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KG; ++kk) {
          s[kk][g] = expf(s[kk][g] - gmax);
          psum += s[kk][g];
        }
        l[g] = l[g] * alpha + psum;
        m[g] = gmax;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
      }
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        const int j = j0 + kk;
        if (j < start || j >= limit) continue;
        float vf[E];
        Hf2qAttnT<T>::template load<E>(vb + (size_t)j * D, vf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] += s[kk][g] * vf[e];
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm[warp][g] = m[g];
      sl[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sacc[warp][g][lane * E + e] = acc[g][e];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < G * D; t += WARPS * 32) {
    const int g = t / D;
    const int d = t % D;
    float mx_ = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx_ = fmaxf(mx_, sm[w][g]);
    float num = 0.0f, den = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      if (sm[w][g] == -INFINITY) continue;
      const float a = expf(sm[w][g] - mx_);
      num += sacc[w][g][d] * a;
      den += sl[w][g] * a;
    }
    o[(((size_t)b * L + i) * NQ + h * G + g) * D + d] =
        Hf2qAttnT<T>::to(den > 0.0f ? num / den : 0.0f);
  }
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_row_attention",
        input_names=["q", "k", "v", "off", "scale"],
        output_names=["o"],
        source=_SOURCE,
        header=_HEADER,
    )


def supported(q: mx.array, keys: mx.array, values: mx.array) -> str | None:
    """Why :func:`row_attention_cuda` cannot compute this attention (None when it can)."""
    if q.dtype not in (mx.bfloat16, mx.float16) or keys.dtype != q.dtype or values.dtype != q.dtype:
        return f"dtypes {q.dtype}/{keys.dtype}/{values.dtype} (needs bf16 or fp16, all the same)"
    if q.ndim != 4 or keys.ndim != 4 or values.shape != keys.shape:
        return f"shapes q {q.shape}, keys {keys.shape}, values {values.shape}"
    B, nq, _, D = q.shape
    if keys.shape[0] != B or keys.shape[3] != D:
        return f"keys {keys.shape} do not match queries {q.shape}"
    if D % 32:
        return f"head size {D} is not a multiple of 32"
    nkv = keys.shape[1]
    if nq % nkv or not 1 <= nq // nkv <= MAX_GROUP:
        return f"{nq} query heads over {nkv} KV heads (a group of 1 to {MAX_GROUP})"
    return None


def warps(group: int, head_dim: int) -> int:
    """Warps per block: :data:`WARPS`, or half as many where their merge buffer (warps x group x
    head size floats) would pass 32 KB. A function of the head sizes only: the key-group-to-warp
    assignment, hence the summation order, is the same for a verify block and a decode step."""
    return WARPS if WARPS * group * head_dim * 4 <= 32 * 1024 else WARPS // 2


@cache
def _scale(value: float) -> mx.array:
    # One constant per scale: a new array per call would be one more transfer per layer.
    out = mx.array([value], dtype=mx.float32)
    mx.eval(out)
    return out


def row_attention_cuda(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: mx.array,
    scale: float,
    *,
    window: int | None = None,
) -> mx.array:
    """Causal attention of query rows over their own keys; see the module docstring.

    Args:
        q: (B, n_q, L, D) queries (rotated), bf16 or fp16.
        keys, values: (B, n_kv, C, D) cache buffers; row b's key at position p sits at index p.
        offset: (B,) or (1,) int32, the position of each batch row's first query row (the
            cache's offset before the new rows); query row i sees keys ``0 .. offset + i`` (the
            last ``window`` of them with a sliding window).
        scale: the softmax scale.

    Returns:
        (B, L, n_q, D) in the queries' dtype.
    """
    B, nq, L, D = q.shape
    nkv = keys.shape[1]
    nw = warps(nq // nkv, D)
    if offset.dtype != mx.int32:
        offset = offset.astype(mx.int32)
    (o,) = _kernel()(
        inputs=[q, keys, values, offset.reshape(-1) if offset.ndim != 1 else offset, _scale(scale)],
        template=[
            ("T", q.dtype),
            ("G", nq // nkv),
            ("D", D),
            ("WARPS", nw),
            ("WINDOW", int(window or 0)),
        ],
        grid=(B * L * nkv * 32 * nw, 1, 1),
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[(B, L, nq, D)],
        output_dtypes=[q.dtype],
    )
    return o
