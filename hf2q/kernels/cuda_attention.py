"""Row-invariant attention over a KV cache for MLX's CUDA backend (bf16 / fp16).

What it does: ``row_attention_cuda(q, keys, values, offset, scale)`` computes causal scaled
dot-product attention of query row i of batch row b over the keys at positions
``0 .. offset[b] + i`` of that batch row (and only those; ``causal=False``: the whole block,
``0 .. offset[b] + L - 1``, as a DFlash draft block attends) and returns it as (B, L, n_q, D), the
layout the output projection reads: one ``mx.fast.cuda_kernel`` launch while the cache holds at
most :data:`CHUNK` positions, else one launch per chunk of keys and one merging them. The
offsets are the cache's own (its positions before the new rows), so no position or mask array is
built: on a GPU every extra graph node costs the host more than this kernel's work at decoding
sizes.

Why: greedy DFlash is lossless when the verify computes every row exactly as plain decoding
computes that step. In half precision MLX's attention does not: one query runs its vector
kernel, 16 queries cuDNN, and the two round differently (``benchmarks/row_invariance.py`` on
the H200: the first attention layer is where verify rows and decode steps part; the layers
before it are already bit-equal). Here a query row's result depends only on that row's query,
its position and the keys it sees, never on how many rows are computed together, so a verify
block and the decode steps it stands for give the same bits. It also needs no mask array: the
visible keys follow from the position, and the whole cache buffer is read in place (no view,
no padding copy).

Layout of the work: one thread block of :func:`warps` warps per (batch row, query row, KV head,
chunk of :data:`CHUNK` keys at fixed absolute positions, :func:`heads_per_block` of the KV head's
group of query heads) computes that row for those heads (GQA). Keys are cut into groups of 8 at
fixed absolute positions; group t goes to warp ``t % warps``, which issues the group's key and
value loads before using any. Lane l holds elements ``l*D/32 ..`` of every query head, key and
value row (coalesced loads of whole rows), so a score is a butterfly sum over the warp (every
lane gets the same bits); each warp keeps a running (max, sum, output) online-softmax state in
float32, rescaled once per group, and accumulates ``p * v`` key by key. The warps' states are
merged in warp order into the chunk's, the chunks' in chunk order, and the result is rounded
once to the output dtype. Every order in this depends only on absolute key positions, the row's
own limit and the head sizes, and a row with one chunk gives the same bits through the single
launch and through the chunked pair (the first chunk's scale factor is exp(0) = 1).

What it does not do: float32 (MLX's attention there agrees to rounding and the tokens are equal;
tested), quantized caches, attention sinks, masks other than causal (plus an optional sliding
window), head sizes that are not a multiple of 32, or more than :data:`MAX_GROUP` query heads per
KV head (:func:`supported` says which).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx

from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.kernels.cuda_gated_delta import _HEADER as _GDN_HEADER

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
};
template <> struct Hf2qAttnT<__half> {
  static __device__ __forceinline__ float f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half to(float x) { return __float2half(x); }
};
// N consecutive elements as raw words (one 16-, 8- or 4-byte load where N is 8, 4 or 2: rows
// start 16-byte aligned and a lane's N elements at a multiple of N), loaded before their use so
// that a key group's loads are in flight together; hf2q_attn_raw_f converts them to float.
constexpr int hf2q_attn_align(int bytes) {
  return (bytes & -bytes) < 16 ? (bytes & -bytes) : 16;  // lowest set bit, at most 16
}
template <typename T, int N> struct alignas(hf2q_attn_align(N * sizeof(T))) Hf2qAttnRaw {
  T e[N];
};
template <typename T, int N>
__device__ __forceinline__ void hf2q_attn_raw_load(const T* p, Hf2qAttnRaw<T, N>& r) {
  if constexpr (N == 8) {
    *reinterpret_cast<uint4*>(r.e) = *reinterpret_cast<const uint4*>(p);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint2*>(r.e) = *reinterpret_cast<const uint2*>(p);
  } else if constexpr (N == 2) {
    *reinterpret_cast<unsigned*>(r.e) = *reinterpret_cast<const unsigned*>(p);
  } else {
#pragma unroll
    for (int u = 0; u < N; ++u) r.e[u] = p[u];
  }
}
template <typename T, int N>
__device__ __forceinline__ void hf2q_attn_raw_f(const Hf2qAttnRaw<T, N>& r, float* out) {
#pragma unroll
  for (int u = 0; u < N; ++u) out[u] = Hf2qAttnT<T>::f(r.e[u]);
}
"""

# The work of one thread block: the keys of one chunk [lo, hi) for one (batch row, query row, KV
# head). Each warp takes the key groups t (8 keys at absolute positions 8t ..) with
# t % WARPS == warp and leaves its online-softmax state (max, sum per head; output elements per
# lane) in shared memory; hf2q_attn_merge_warps then combines them in warp order.
_CHUNK = r"""
template <typename T, int G, int D, int WARPS>
__device__ __forceinline__ void hf2q_attn_warps(const T* qrow, size_t q_head_stride, const T* kb,
                                                const T* vb, int lo, int hi, float sc,
                                                float (*sm)[G], float (*sl)[G],
                                                float (*sacc)[G][D]) {
  constexpr int E = D / 32;  // elements of a query/key/value row per lane
  constexpr int KG = 8;      // keys per group: loads in flight, one softmax rescale per group
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float qr[G][E], m[G], l[G], acc[G][E];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = qrow + g * q_head_stride + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) qr[g][e] = Hf2qAttnT<T>::f(qp[e]) * sc;
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
  }
  kb += lane * E;
  vb += lane * E;
  if (hi > lo) {
    const int g0 = lo / KG;
    const int g1 = (hi - 1) / KG;
    const int first = g0 + (((warp - g0) % WARPS) + WARPS) % WARPS;
    for (int gi = first; gi <= g1; gi += WARPS) {
      const int j0 = gi * KG;
      float s[KG][G];
      // The group's key and value rows first, every load issued before any is used (the values
      // do not depend on the scores): one memory latency a group instead of one a value row.
      // Lane holds E elements of each row (coalesced loads); keys outside [lo, hi) read as 0.
      Hf2qAttnRaw<T, E> kr[KG], vr[KG];
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        const int j = j0 + kk;
        if (j >= lo && j < hi) {
          hf2q_attn_raw_load<T, E>(kb + (size_t)j * D, kr[kk]);
          hf2q_attn_raw_load<T, E>(vb + (size_t)j * D, vr[kk]);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) kr[kk].e[e] = Hf2qAttnT<T>::to(0.0f);
        }
      }
      // Scores: a butterfly sums each key's lane products.
#pragma unroll
      for (int kk = 0; kk < KG; ++kk) {
        float kf[E];
        hf2q_attn_raw_f<T, E>(kr[kk], kf);
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
          s[kk][g] = (j >= lo && j < hi) ? x : -INFINITY;
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
        if (j < lo || j >= hi) continue;
        float vf[E];
        hf2q_attn_raw_f<T, E>(vr[kk], vf);
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
}

// The chunk's (max, sum, output numerator) for head g, element d: the warps' states in warp order.
template <int G, int D, int WARPS>
__device__ __forceinline__ void hf2q_attn_merge_warps(float (*sm)[G], float (*sl)[G],
                                                      float (*sacc)[G][D], int g, int d, float& m,
                                                      float& l, float& a) {
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) m = fmaxf(m, sm[w][g]);
  l = 0.0f;
  a = 0.0f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    if (sm[w][g] == -INFINITY) continue;
    const float f = expf(sm[w][g] - m);
    a += sacc[w][g][d] * f;
    l += sl[w][g] * f;
  }
}
"""

# Which (b, i, h) this block's ``row`` is and its visible keys [start, limit); every kernel.
_LIMITS = r"""
  const int NQ = q_shape[1];
  const int L = q_shape[2];
  const int NKV = k_shape[1];
  const int C = k_shape[2];
  const int h = row % NKV;
  const int i = (row / NKV) % L;
  const int b = row / (NKV * L);
  const int first = off[off_shape[0] == 1 ? 0 : b];
  int limit = CAUSAL ? first + i + 1 : first + L;
  if (limit > C) limit = C;
  int start = 0;
  if (WINDOW > 0 && first + i + 1 - WINDOW > 0) start = first + i + 1 - WINDOW;
"""

# The row's query, key and value pointers and the warps' merge buffers (the attending kernels).
_ROW = (
    _LIMITS
    + r"""
  const int g0 = hs * HB;  // the block's first query head in the KV head's group
  const T* qrow = q + (((size_t)b * NQ + h * G + g0) * L + i) * D;
  const T* kb = k + ((size_t)b * NKV + h) * (size_t)C * D;
  const T* vb = v + ((size_t)b * NKV + h) * (size_t)C * D;
  __shared__ float sm[WARPS][HB];
  __shared__ float sl[WARPS][HB];
  __shared__ float sacc[WARPS][HB][D];
"""
)

# Template arguments: T (bf16/fp16), G (query heads per KV head), HB (query heads a block
# computes: a divisor of G; each head's work is the same whatever HB, so HB changes no bit, only
# how many blocks share the work and how many registers each thread holds), D (head size, a
# multiple of 32), WARPS, CAUSAL (1: row i sees keys up to its own position; 0: every row sees
# the whole block, as a DFlash draft block does), WINDOW (0: no sliding window; else keys within
# WINDOW of the row's position); CH (keys per chunk) for the chunked pair. Inputs q (B, NQ, L, D),
# k/v (B, NKV, C, D) cache buffers, off (B,) or (1,) int32 position of each batch
# row's first query row, scale (1,) float32.

# Whole rows in one block (every row's keys fit one chunk), HB heads of a row a block: output o
# (B, L, NQ, D).
_SOURCE = (
    "  const int row = blockIdx.x / (G / HB);\n"
    "  const int hs = blockIdx.x % (G / HB);\n"
    + _ROW
    + r"""
  hf2q_attn_warps<T, HB, D, WARPS>(qrow, (size_t)L * D, kb, vb, start, limit, scale[0], sm, sl, sacc);
  for (int t = threadIdx.x; t < HB * D; t += WARPS * 32) {
    const int g = t / D;
    const int d = t % D;
    float m, l, a;
    hf2q_attn_merge_warps<HB, D, WARPS>(sm, sl, sacc, g, d, m, l, a);
    o[(((size_t)b * L + i) * NQ + h * G + g0 + g) * D + d] = Hf2qAttnT<T>::to(a / l);
  }
"""
)

# One block per (row, chunk c of CH keys at positions c*CH .., HB heads): the chunk's state,
# float32, in part (B*L*NKV, NCH, G, D) and ml (B*L*NKV, NCH, G, 2); chunks past the row's keys
# write nothing.
_SOURCE_PART = (
    "  const int NCH = (k_shape[2] + CH - 1) / CH;\n"
    "  const int row = blockIdx.x / (NCH * (G / HB));\n"
    "  const int c = (blockIdx.x / (G / HB)) % NCH;\n"
    "  const int hs = blockIdx.x % (G / HB);\n"
    + _ROW
    + r"""
  const int lo = max(start, c * CH);
  const int hi = min(limit, (c + 1) * CH);
  if (lo >= hi) return;
  hf2q_attn_warps<T, HB, D, WARPS>(qrow, (size_t)L * D, kb, vb, lo, hi, scale[0], sm, sl, sacc);
  const size_t base = (size_t)row * NCH + c;
  for (int t = threadIdx.x; t < HB * D; t += WARPS * 32) {
    const int g = t / D;
    const int d = t % D;
    float m, l, a;
    hf2q_attn_merge_warps<HB, D, WARPS>(sm, sl, sacc, g, d, m, l, a);
    part[(base * G + g0) * D + t] = a;
    if (d == 0) {
      ml[(base * G + g0 + g) * 2] = m;
      ml[(base * G + g0 + g) * 2 + 1] = l;
    }
  }
"""
)

# The chunks of each row merged in chunk order: output o (B, L, NQ, D). For a row with one chunk
# this is a / l of that chunk, bit for bit what the whole-row kernel writes (the scale factor of
# the first chunk is exp(0) = 1 and the sums start from it).
_SOURCE_MERGE = (
    "  const int NCH = part_shape[1];\n"
    "  const int row = blockIdx.x;\n"
    + _LIMITS
    + r"""
  const int c0 = start / CH;
  const int c1 = (limit - 1) / CH;
  // Chunks taken MU at a time, their loads issued before any is used (one memory latency per
  // MU chunks); the operations and their order are those of one chunk at a time.
  constexpr int MU = 4;
  for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
    const int g = t / D;
    const int d = t % D;
    float m = -INFINITY;
    for (int c = c0; c <= c1; c += MU) {
      float mv[MU];
#pragma unroll
      for (int u = 0; u < MU; ++u)
        mv[u] = c + u <= c1 ? ml[(((size_t)row * NCH + c + u) * G + g) * 2] : -INFINITY;
#pragma unroll
      for (int u = 0; u < MU; ++u) m = fmaxf(m, mv[u]);
    }
    float a = 0.0f, l = 0.0f;
    for (int c = c0; c <= c1; c += MU) {
      float pv[MU], mv[MU], lv[MU];
#pragma unroll
      for (int u = 0; u < MU; ++u) {
        if (c + u > c1) continue;
        const size_t base = (size_t)row * NCH + c + u;
        pv[u] = part[base * G * D + t];
        mv[u] = ml[(base * G + g) * 2];
        lv[u] = ml[(base * G + g) * 2 + 1];
      }
#pragma unroll
      for (int u = 0; u < MU; ++u) {
        if (c + u > c1) continue;
        const float f = expf(mv[u] - m);
        if (c + u == c0) {
          a = pv[u] * f;
          l = lv[u] * f;
        } else {
          a += pv[u] * f;
          l += lv[u] * f;
        }
      }
    }
    o[(((size_t)b * L + i) * NQ + h * G + g) * D + d] = Hf2qAttnT<T>::to(a / l);
  }
"""
)

#: Keys per chunk of the chunked pair (a multiple of the 8-key groups; fixed absolute positions).
CHUNK = 256

# Qwen3.5's output gate in the store (``gate`` given): ``o * sigmoid(g)`` as MLX's CUDA
# elementwise kernels compute it in the output's dtype (the attention rounded once, the
# sigmoid's intermediates rounded, the product rounded: hf2q_sigmoid of the Gated-DeltaNet
# kernels' header), for ``g`` at element ``GO + d`` of the row's head in a gate source of ``GS``
# elements a head: the q projection's output itself (GS = 2 D, GO = D: the gate after each head's
# queries, as mlx-lm splits it), not a copy of its gate half.
_GATE_HEADER = r"""
template <typename T>
__device__ __forceinline__ T hf2q_attn_gated(float a, T g) {
  return hf2q_to<T>(hf2q_round<T>(a) * hf2q_sigmoid<T>(hf2q_f(g)));
}
"""

_STORE = re.compile(
    r"o\[\(\(\(size_t\)b \* L \+ i\) \* NQ \+ (?P<head>[^)]*)\) \* D \+ d\] = "
    r"Hf2qAttnT<T>::to\(a / l\);"
)


def _gated(source: str) -> str:
    """``source`` with its one store of ``o`` gated (see ``_GATE_HEADER``)."""

    def store(m: re.Match) -> str:
        row = f"((size_t)b * L + i) * NQ + {m['head']}"
        return f"o[({row}) * D + d] = hf2q_attn_gated<T>(a / l, gate[({row}) * GS + GO + d]);"

    out, n = _STORE.subn(store, source)
    assert n == 1, "the source's store of o is not where _gated looks for it"
    return out


#: Each launch's name, input names, output names, source and header (the CPU tests build the
#: same in their emulator).
SPECS: dict[str, tuple[str, list[str], list[str], str, str]] = {
    "whole": (
        "hf2q_row_attention",
        ["q", "k", "v", "off", "scale"],
        ["o"],
        _SOURCE,
        _HEADER + _CHUNK,
    ),
    "part": (
        "hf2q_row_attention_part",
        ["q", "k", "v", "off", "scale"],
        ["part", "ml"],
        _SOURCE_PART,
        _HEADER + _CHUNK,
    ),
    "merge": (
        "hf2q_row_attention_merge",
        ["q", "k", "off", "part", "ml"],
        ["o"],
        _SOURCE_MERGE,
        _HEADER,
    ),
    "whole_gated": (
        "hf2q_row_attention_gated",
        ["q", "k", "v", "off", "scale", "gate"],
        ["o"],
        _gated(_SOURCE),
        _HEADER + _CHUNK + _GDN_HEADER + _GATE_HEADER,
    ),
    "merge_gated": (
        "hf2q_row_attention_merge_gated",
        ["q", "k", "off", "part", "ml", "gate"],
        ["o"],
        _gated(_SOURCE_MERGE),
        _HEADER + _GDN_HEADER + _GATE_HEADER,
    ),
}


@cache
def _kernel(kind: str = "whole") -> Any:
    name, inputs, outputs, source, header = SPECS[kind]
    return mx.fast.cuda_kernel(
        name=name, input_names=inputs, output_names=outputs, source=source, header=header
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


#: HF2Q_ATTN_HEADS=N: query heads one thread block computes (a divisor of the group; the
#: largest divisor at most N), for tuning on a GPU. No bit depends on it.
HEADS_ENV = "HF2Q_ATTN_HEADS"


def heads_per_block(group: int) -> int:
    """Query heads of the KV head's group one thread block computes (a divisor of ``group``).
    Every head's work and its order are the same whatever this is, so it changes no bit: it
    trades blocks (each reads the group's keys and values again, from L2 after the first) for
    registers a thread holds (each head's query, output and scores). Default 2: on the H200
    (session 39, kernel traces of the 4B-shaped pair's loops at 1024 positions, us a layer for
    1 / 2 / 4 heads a block) a decode step's attention 23.0 / 19.5 / 19.9, a verify's 50.5 /
    44.4 / 51.8, the drafter's 54.4 / 56.0 / 64.7."""
    raw = os.environ.get(HEADS_ENV, "").strip()
    want = 2
    if raw:
        want = int(raw) if raw.isdigit() else 0
        if want < 1:
            raise UsageError(
                f"{HEADS_ENV}={raw!r} must be a number of query heads, e.g. 2: unset it or fix it"
            )
    want = min(want, group)
    while group % want:
        want -= 1
    return want


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
    offset: int | mx.array,
    scale: float,
    *,
    window: int | None = None,
    causal: bool = True,
    gate: mx.array | None = None,
    gate_layout: tuple[int, int] = (0, 0),
) -> mx.array:
    """Attention of query rows over their own keys; see the module docstring.

    Args:
        q: (B, n_q, L, D) queries (rotated), bf16 or fp16.
        keys, values: (B, n_kv, C, D) cache buffers; row b's key at position p sits at index p.
        offset: the position of each batch row's first query row (the cache's offset before
            the new rows): an int (every row; passed as a constant, not a graph node) or an
            int32 array (B,); query row i sees keys ``0 .. offset + i`` (the last ``window`` of
            them with a sliding window).
        scale: the softmax scale.
        causal: False: every query row sees keys ``0 .. offset + L - 1`` (the whole block of L
            new rows, as a DFlash draft block attends), still within ``window`` of its position.
        gate: Qwen3.5's output gate, applied in the store (``o * sigmoid(gate)`` with MLX's
            roundings: the bits of mlx-lm's multiply after the attention): (B, L, n_q * GS)
            where ``gate_layout`` is ``(GS, GO)``, head h's gate at elements ``h * GS + GO ..``
            (the q projection's output: ``(2 * D, D)``).

    Returns:
        (B, L, n_q, D) in the queries' dtype.
    """
    if isinstance(offset, int):
        offset = mx.array([offset], dtype=mx.int32)
    else:  # slot caches already hold (B,) int32: nothing to add to the graph then
        if offset.dtype != mx.int32:
            offset = offset.astype(mx.int32)
        if offset.ndim != 1:
            offset = offset.reshape(-1)
    layout = None if gate is None else gate_layout
    run = _launcher(float(scale), int(window or 0), bool(causal), layout)
    return run(q, keys, values, offset, *([] if gate is None else [gate]))


@cache
def _launcher(
    scale: float, window: int, causal: bool, gate_layout: tuple[int, int] | None
) -> Callable[..., mx.array]:
    """The launches for one (scale, window, causal, gate layout or None: ungated),
    ``mx.compile``'d on CUDA: MLX builds a custom kernel's whole source text on every call of
    its Python function (about as long as the header), a compiled trace replays the kernel node
    instead. Elsewhere (the CPU tests' emulator) the plain function."""
    fn = functools.partial(
        _launch, scale=scale, window=window, causal=causal, gate_layout=gate_layout
    )
    return mx.compile(fn) if select.backend() == "cuda" else fn


def _launch(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: mx.array,
    gate: mx.array | None = None,
    *,
    scale: float,
    window: int,
    causal: bool,
    gate_layout: tuple[int, int] | None = None,
) -> mx.array:
    B, nq, L, D = q.shape
    nkv, C = keys.shape[1], keys.shape[2]
    G = nq // nkv
    nw = warps(G, D)
    hb = heads_per_block(G)
    template = [
        ("T", q.dtype),
        ("G", G),
        ("HB", hb),
        ("D", D),
        ("WARPS", nw),
        ("CAUSAL", bool(causal)),
        ("WINDOW", int(window or 0)),
    ]
    rows = B * L * nkv
    inputs = [q, keys, values, offset, _scale(scale)]
    gated = [] if gate_layout is None else [gate]
    gt = [] if gate_layout is None else [("GS", gate_layout[0]), ("GO", gate_layout[1])]
    if C <= CHUNK:  # every row's keys in one chunk: one launch
        (o,) = _kernel("whole" if gate_layout is None else "whole_gated")(
            inputs=inputs + gated,
            template=template + gt,
            grid=(rows * (G // hb) * 32 * nw, 1, 1),
            threadgroup=(32 * nw, 1, 1),
            output_shapes=[(B, L, nq, D)],
            output_dtypes=[q.dtype],
        )
        return o
    nch = -(-C // CHUNK)
    part, ml = _kernel("part")(
        inputs=inputs,
        template=[*template, ("CH", CHUNK)],
        grid=(rows * nch * (G // hb) * 32 * nw, 1, 1),
        threadgroup=(32 * nw, 1, 1),
        output_shapes=[(rows, nch, G, D), (rows, nch, G, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    threads = min(G * D, 1024)  # one thread an output element, up to a block's most
    (o,) = _kernel("merge" if gate_layout is None else "merge_gated")(
        inputs=[q, keys, offset, part, ml, *gated],
        # every head of the group, whichever heads a part block took: no HB to compile for
        template=[*(a for a in template if a[0] != "HB"), ("CH", CHUNK), *gt],
        grid=(rows * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, L, nq, D)],
        output_dtypes=[q.dtype],
    )
    return o
