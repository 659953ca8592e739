"""Gated-DeltaNet recurrence kernels for MLX's CUDA backend (``mx.fast.cuda_kernel``).

What it does: run the gated delta rule over a block of T steps in one launch, with the float32
state of each (batch, value head, value-row tile) held in registers, and record what exact
rollback needs. Two kernels share one recurrence body:

* ``gated_delta_steps_cuda(q, k, v, g, beta, state)``: the plain recurrence over prepared inputs
  (the signature of the runtime's ops reference ``gated_delta_steps``).
* ``gdn_fused_cuda(conv_state, qkv, conv_w, a, b, A_log, dt_bias, state)``: everything between
  the Gated-DeltaNet input projections and the gated norm in one launch: the depthwise causal
  conv + SiLU, the q/k RMS normalisation with the ``Dk**-0.5`` scales, the gates
  ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` and ``beta = sigmoid(b)``, and the recurrence.
  Intermediates are rounded to the model dtype at the points where mlx-lm's ops produce arrays,
  so bf16 results track mlx-lm's own path closely; in float32 both agree to float rounding.

Record modes: ``"states"`` writes the state after every step, (B, T, Hv, Dv, Dk) float32, so
rollback to n kept tokens is the view ``states[:, n-1]``; ``"final"`` writes only the state after
the last step, and rollback replays n steps from the initial state (``steps=`` runs the same
kernel over the first n steps and writes only the final state).

What it does not do: decide whether CUDA is used (see ``hf2q.kernels.select``), handle padding
masks or vector gates (callers fall back to ops), or run anywhere but an NVIDIA GPU.

Layout of the work: thread block = (Dv tile of ``8 * WARPS`` rows, one value head, one batch
row); four lanes share one value row and each holds ``Dk / 4`` state elements, interleaved by
float4 so that state stores are full 64-byte runs. q/k/v/gates of up to ``TC`` steps are staged
in shared memory as float32 per chunk. The block length T is read from the input's shape, so one
compiled kernel per dtype and head geometry serves decode (T=1), verify (T=16) and long prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import mlx.core as mx

#: Steps staged in shared memory per chunk (bounded so long blocks fit in static shared memory).
MAX_CHUNK = 16

_HEADER = r"""
__device__ __forceinline__ float hf2q_f(float x) { return x; }
__device__ __forceinline__ float hf2q_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float hf2q_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T hf2q_to(float x);
template <> __device__ __forceinline__ float hf2q_to<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 hf2q_to<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <> __device__ __forceinline__ __half hf2q_to<__half>(float x) { return __float2half(x); }
// Round a float32 value through dtype T (what storing an mlx array of that dtype does).
template <typename T> __device__ __forceinline__ float hf2q_round(float x) {
  return hf2q_f(hf2q_to<T>(x));
}
// sigmoid and softplus as MLX's CUDA unary/binary ops compute them in dtype T, every
// intermediate rounded to T (a no-op for float32).
template <typename T> __device__ __forceinline__ float hf2q_sigmoid(float x) {
  const float e = hf2q_round<T>(expf(fabsf(x)));
  const float y = hf2q_round<T>(1.0f / hf2q_round<T>(1.0f + e));
  return (x < 0.0f) ? y : hf2q_round<T>(1.0f - y);
}
template <typename T> __device__ __forceinline__ float hf2q_sigmoid_as(const T*, float x) {
  return hf2q_sigmoid<T>(x);
}
template <typename T> __device__ __forceinline__ float hf2q_softplus(float x) {
  const float l = hf2q_round<T>(log1pf(hf2q_round<T>(expf(-fabsf(x)))));
  return hf2q_round<T>(fmaxf(x, 0.0f) + l);
}
// A float summed over the warp by the tree lane + 16, + 8, + 4, + 2, + 1, every lane getting the
// sum (cooperative groups' warp reduce, as MLX's norm kernels add a warp's values).
__device__ __forceinline__ float hf2q_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
"""

# Shared prologue: indices, shared staging buffers, state load. Needs constexprs InT, Dk, Dv, Hk,
# Hv, WARPS, TC (template arguments), the block length T (read from an input's shape, so one
# compiled kernel serves every T) and the input ``state_in``.
_PROLOGUE = r"""
  const int T = __T_FROM_SHAPE__;
  constexpr int NJ = Dk / 16;          // float4 groups per lane
  constexpr int ROWS = 8 * WARPS;      // value rows per block
  constexpr int NT = 32 * WARPS;       // threads per block
  const int tile = blockIdx.x;
  const int hv = blockIdx.y;
  const int bb = blockIdx.z;
  const int hk = hv / (Hv / Hk);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int r = warp * 8 + (lane >> 2);   // value row inside the tile
  const int sub = lane & 3;               // which quarter of the row this lane holds
  const int dv = tile * ROWS + r;
  __shared__ __align__(16) float s_q[TC * Dk];
  __shared__ __align__(16) float s_k[TC * Dk];
  __shared__ float s_v[TC * ROWS];
  __shared__ float s_g[TC];
  __shared__ float s_b[TC];
  // Lane ``sub`` of a row holds elements e = j * 16 + sub * 4 + c, j < NJ, c < 4.
  float st[NJ * 4];
  const size_t srow = ((size_t)(bb * Hv + hv) * Dv + dv) * Dk;
  // The state is read (and the final state written) 16 bytes a load: an H100 took 17.5 -> 11.9 us
  // a one-slot decode layer and 34.3 -> 30.9 a 16-step verify layer (session 49's probe). Rows
  // start at multiples of Dk floats; the scalar read stays for a base that is not 16-byte aligned.
  if ((reinterpret_cast<size_t>(state_in) & 15) == 0) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float4 sv = *reinterpret_cast<const float4*>(state_in + srow + j * 16 + sub * 4);
      st[j * 4 + 0] = sv.x;
      st[j * 4 + 1] = sv.y;
      st[j * 4 + 2] = sv.z;
      st[j * 4 + 3] = sv.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        st[j * 4 + c] = state_in[srow + j * 16 + sub * 4 + c];
      }
    }
  }
"""

# Loads of one chunk for the plain kernel (inputs q, k, v, g, beta already prepared).
_LOAD_PLAIN = r"""
    for (int i = tid; i < tc * Dk; i += NT) {
      const int tt = i / Dk;
      const int e = i - tt * Dk;
      const size_t src = ((size_t)(bb * T + t0 + tt) * Hk + hk) * Dk + e;
      s_q[i] = hf2q_f(q[src]);
      s_k[i] = hf2q_f(k[src]);
    }
    for (int i = tid; i < tc * ROWS; i += NT) {
      const int tt = i / ROWS;
      const int rr = i - tt * ROWS;
      s_v[i] = hf2q_f(v[((size_t)(bb * T + t0 + tt) * Hv + hv) * Dv + tile * ROWS + rr]);
    }
    if (tid < tc) {
      const size_t gi = (size_t)(bb * T + t0 + tid) * Hv + hv;
      s_g[tid] = hf2q_f(g[gi]);
      s_b[tid] = hf2q_f(beta[gi]);
    }
    __syncthreads();
"""

# Loads of one chunk for the fused kernel: conv + SiLU, gates, then q/k RMS normalisation.
# Needs constexprs KC (conv kernel size) and GT (dtype of a + dt_bias). A thread per channel of
# the block's share (the key head's q and k channels, the tile's value rows): it reads the
# channel's KC taps and the chunk's tc + KC - 1 conv rows, every load issued before any is used,
# then computes the chunk's tc outputs from registers. (Session 48: the per-(step, channel) loop
# of ``_LOAD_FUSED_STEPS`` walked 32 loops of dependent global loads a thread at 16 steps; with
# this read a 4B-shaped one-slot verify layer took 22.6 us on an H100 instead of 27.3. The sums
# are the same.)
_LOAD_FUSED = r"""
    for (int c = tid; c < 2 * Dk + ROWS; c += NT) {
      const int ch = (c < Dk) ? (hk * Dk + c)
          : (c < 2 * Dk) ? (Hk * Dk + hk * Dk + (c - Dk))
          : (2 * Hk * Dk + hv * Dv + tile * ROWS + (c - 2 * Dk));
      float wc[KC];
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        wc[j] = hf2q_f(conv_w[ch * KC + j]);
      }
      float xr[TC + KC - 1];
#pragma unroll
      for (int u = 0; u < TC + KC - 1; ++u) {
        if (u < tc + KC - 1) {
          xr[u] = hf2q_conv_in(t0 + u, ch);
        } else {
          xr[u] = 0.0f;
        }
      }
#pragma unroll
      for (int tt = 0; tt < TC; ++tt) {
        if (tt < tc) {
          float acc = 0.0f;
#pragma unroll
          for (int j = 0; j < KC; ++j) {
            acc += wc[j] * xr[tt + j];
          }
          const float val = hf2q_silu_conv(acc);
          if (c < Dk) {
            s_q[tt * Dk + c] = val;
          } else if (c < 2 * Dk) {
            s_k[tt * Dk + (c - Dk)] = val;
          } else {
            s_v[tt * ROWS + (c - 2 * Dk)] = val;
          }
        }
      }
    }
"""

# The loads before session 48 (``Variant.step_loads``): a thread per (step, channel), each conv
# output's KC rows read where it is computed. Same values as ``_LOAD_FUSED``; kept as the
# baseline ``benchmarks/gdn_loads.py`` times and the tests compare bits with.
_LOAD_FUSED_STEPS = r"""
    for (int i = tid; i < tc * 2 * Dk; i += NT) {
      const int tt = i / (2 * Dk);
      const int e2 = i - tt * 2 * Dk;
      const int ch = (e2 < Dk) ? (hk * Dk + e2) : (Hk * Dk + hk * Dk + (e2 - Dk));
      const float val = hf2q_conv_silu(t0 + tt, ch);
      if (e2 < Dk) {
        s_q[tt * Dk + e2] = val;
      } else {
        s_k[tt * Dk + (e2 - Dk)] = val;
      }
    }
    for (int i = tid; i < tc * ROWS; i += NT) {
      const int tt = i / ROWS;
      const int rr = i - tt * ROWS;
      s_v[i] = hf2q_conv_silu(t0 + tt, 2 * Hk * Dk + hv * Dv + tile * ROWS + rr);
    }
"""

# The chunk's gates, then mlx-lm's q/k normalisation in shared memory (both loaders).
_GATES_NORM = r"""    if (tid < tc) {
      const size_t gi = (size_t)(bb * T + t0 + tid) * Hv + hv;
      const float xa = hf2q_round<GT>(hf2q_f(a[gi]) + hf2q_f(dt_bias[hv]));
      const float sp = hf2q_softplus<GT>(xa);
      s_g[tid] = expf(-expf(hf2q_f(A_log[hv])) * sp);
      s_b[tid] = hf2q_sigmoid_as(b, hf2q_f(b[gi]));
    }
    __syncthreads();
    // mlx-lm's normalize_qk: rms_norm(x, eps * Dk^-1) (rounded to the model dtype), times
    // Dk^-1 for q and Dk^-0.5 for k (the scalar itself rounded to the model dtype).
    for (int row = warp; row < 2 * tc; row += WARPS) {
      float* x = (row < tc) ? (s_q + row * Dk) : (s_k + (row - tc) * Dk);
      float ss = 0.0f;
      for (int e = lane; e < Dk; e += 32) {
        ss += x[e] * x[e];
      }
      ss = hf2q_warp_sum(ss);
      const float inv = rsqrtf(ss / (float)Dk + rms_eps);
      const float scale = (row < tc) ? q_scale : k_scale;
      for (int e = lane; e < Dk; e += 32) {
        x[e] = hf2q_round<InT>(hf2q_round<InT>(x[e] * inv) * scale);
      }
    }
    __syncthreads();
"""

# Fused-kernel helpers defined inside the body (they read the kernel's inputs by name).
_FUSED_SETUP = r"""
  constexpr int CH = 2 * Hk * Dk + Hv * Dv;   // conv channels
  const double inv_scale = 1.0 / sqrt((double)Dk);
  const float k_scale = hf2q_round<InT>((float)inv_scale);
  const float q_scale = hf2q_round<InT>((float)(inv_scale * inv_scale));
  const float rms_eps = (float)(1e-6 * (inv_scale * inv_scale));
  // Row rw of concat(conv_state, qkv) at channel ch (the conv's input).
  auto hf2q_conv_in = [&](int rw, int ch) -> float {
    return (rw < KC - 1)
          ? hf2q_f(conv_state[((size_t)bb * (KC - 1) + rw) * CH + ch])
          : hf2q_f(qkv[((size_t)bb * T + (rw - (KC - 1))) * CH + ch]);
  };
  // SiLU of a conv sum with mlx-lm's roundings (conv output, sigmoid, product each stored in
  // the model dtype).
  auto hf2q_silu_conv = [&](float acc) -> float {
    const float xc = hf2q_round<InT>(acc);
    return hf2q_round<InT>(xc * hf2q_sigmoid<InT>(xc));
  };
"""

# ``_LOAD_FUSED_STEPS``'s helper (defined only there: nvcc warns of an unused lambda): the
# depthwise causal conv over rows [t, t + KC), then SiLU.
_CONV_SILU = r"""
  auto hf2q_conv_silu = [&](int t, int ch) -> float {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      acc += hf2q_f(conv_w[ch * KC + j]) * hf2q_conv_in(t + j, ch);
    }
    return hf2q_silu_conv(acc);
  };
"""

# The recurrence over one staged chunk; writes y and/or per-step states as configured.
_STEPS = r"""
    for (int tt = 0; tt < tc; ++tt) {
      const float gt = s_g[tt];
      const float bt = s_b[tt];
      const float4* k4 = reinterpret_cast<const float4*>(s_k + tt * Dk);
      const float4* q4 = reinterpret_cast<const float4*>(s_q + tt * Dk);
      float kv = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float4 kk = k4[j * 4 + sub];
        st[j * 4 + 0] *= gt;
        st[j * 4 + 1] *= gt;
        st[j * 4 + 2] *= gt;
        st[j * 4 + 3] *= gt;
        kv += st[j * 4 + 0] * kk.x;
        kv += st[j * 4 + 1] * kk.y;
        kv += st[j * 4 + 2] * kk.z;
        kv += st[j * 4 + 3] * kk.w;
      }
      kv += __shfl_xor_sync(0xffffffffu, kv, 1);
      kv += __shfl_xor_sync(0xffffffffu, kv, 2);
      const float delta = (s_v[tt * ROWS + r] - kv) * bt;
      float out = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float4 kk = k4[j * 4 + sub];
        const float4 qq = q4[j * 4 + sub];
        st[j * 4 + 0] += kk.x * delta;
        st[j * 4 + 1] += kk.y * delta;
        st[j * 4 + 2] += kk.z * delta;
        st[j * 4 + 3] += kk.w * delta;
        out += st[j * 4 + 0] * qq.x;
        out += st[j * 4 + 1] * qq.y;
        out += st[j * 4 + 2] * qq.z;
        out += st[j * 4 + 3] * qq.w;
      }
      out += __shfl_xor_sync(0xffffffffu, out, 1);
      out += __shfl_xor_sync(0xffffffffu, out, 2);
      __WRITE_Y__
      __WRITE_STEP_STATE__
    }
"""

_WRITE_Y = r"""if (sub == 0) {
        y[((size_t)(bb * T + t0 + tt) * Hv + hv) * Dv + dv] = hf2q_to<InT>(out);
      }"""

_WRITE_STEP_STATE = r"""{
        float4* dst = reinterpret_cast<float4*>(
            states + (((size_t)(bb * T + t0 + tt) * Hv + hv) * Dv + dv) * Dk);
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          dst[j * 4 + sub] = make_float4(
              st[j * 4 + 0], st[j * 4 + 1], st[j * 4 + 2], st[j * 4 + 3]);
        }
      }"""

_WRITE_FINAL = r"""
  {
    // an output of its own: 16-byte aligned, as the per-step states' writes take it to be
    float4* dst = reinterpret_cast<float4*>(state_out + srow);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      dst[j * 4 + sub] = make_float4(st[j * 4 + 0], st[j * 4 + 1], st[j * 4 + 2], st[j * 4 + 3]);
    }
  }
"""


#: The conv read of the joined variant: one input ``conv_input`` (B, K-1+T, C) holds the conv
#: rows before the block and the block's rows (what a verify's record keeps), so a replay reads
#: the record as it is instead of two strided slices of it (each a graph node and, for several
#: rows, a copy to make it contiguous).
_SPLIT_READ = """(rw < KC - 1)
          ? hf2q_f(conv_state[((size_t)bb * (KC - 1) + rw) * CH + ch])
          : hf2q_f(qkv[((size_t)bb * T + (rw - (KC - 1))) * CH + ch])"""
_JOINED_READ = "hf2q_f(conv_input[((size_t)bb * (KC - 1 + T) + rw) * CH + ch])"


#: The window variant (fused, split read) also writes the block's whole conv window
#: ``window`` (B, K-1+T, C): the conv rows before the block, then the block's rows, what a
#: verify's record keeps and a decode step's next conv state is cut from. Without it the caller
#: joins the two with a concatenate: two copy launches and graph nodes in every Gated-DeltaNet
#: layer of every step. Per batch row the window is the two inputs' rows back to back, so the
#: row's blocks split it as one flat copy, each a contiguous share; every thread loads 8
#: elements before storing them (loads first: the output may alias an input as far as the
#: compiler knows, so a load-store loop would wait out each load in turn; session 25's first
#: version, a loop over channels in a few blocks, made a 1-slot DFlash round 2.3 ms slower).
_WRITE_WINDOW = r"""
  {
    constexpr int TILES = Dv / ROWS;
    const size_t E0 = (size_t)(KC - 1) * CH;
    const size_t E = E0 + (size_t)T * CH;
    const size_t per = (E + TILES * Hv - 1) / (TILES * Hv);
    const size_t lo = (size_t)(tile + TILES * hv) * per;
    const size_t hi = min(E, lo + per);
    const InT* cs = conv_state + (size_t)bb * E0;
    const InT* xs = qkv + (size_t)bb * (E - E0);
    InT* out = window + (size_t)bb * E;
    for (size_t base = lo; base < hi; base += 8 * NT) {
      InT buf[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const size_t e = base + (size_t)u * NT + tid;
        if (e < hi) buf[u] = (e < E0) ? cs[e] : xs[e - E0];
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const size_t e = base + (size_t)u * NT + tid;
        if (e < hi) out[e] = buf[u];
      }
    }
  }
"""


@dataclass(frozen=True)
class Variant:
    """Which kernel: ``fused`` (conv, norms and gates inside) or the plain recurrence over
    prepared inputs; ``record`` ``"states"`` or ``"final"``; ``write_y``; ``replay`` (a count of
    steps per batch row); ``joined`` (fused only: the conv rows as one ``conv_input``, see
    ``_JOINED_READ``); ``window`` (fused, split read only: also write that conv window, see
    ``_WRITE_WINDOW``); ``step_loads`` (fused only: the conv read per (step, channel),
    ``_LOAD_FUSED_STEPS``, the loads before session 48, for timing and bit checks)."""

    fused: bool
    record: str
    write_y: bool
    replay: bool
    joined: bool = False
    window: bool = False
    step_loads: bool = False

    def __post_init__(self) -> None:
        if self.joined and not self.fused:
            raise ValueError("only the fused kernel reads a joined conv input")
        if self.window and (self.joined or not self.fused):
            raise ValueError("only the fused kernel's split read writes the conv window")
        if self.step_loads and not self.fused:
            raise ValueError("step_loads: a choice of the fused kernel's conv read")


def _source(v: Variant) -> str:
    fused, record, write_y, replay, joined = v.fused, v.record, v.write_y, v.replay, v.joined
    n_steps = "min(T, (int)steps[bb])" if replay else "T"  # each batch row its own count
    steps = _STEPS.replace("__WRITE_Y__", _WRITE_Y if write_y else "")
    steps = steps.replace("__WRITE_STEP_STATE__", _WRITE_STEP_STATE if record == "states" else "")
    t_from = "a_shape[1]" if joined else ("qkv_shape[1]" if fused else "q_shape[1]")
    body = _PROLOGUE.replace("__T_FROM_SHAPE__", t_from)
    if fused:
        assert _SPLIT_READ in _FUSED_SETUP
        body += _FUSED_SETUP.replace(_SPLIT_READ, _JOINED_READ) if joined else _FUSED_SETUP
        body += _CONV_SILU if v.step_loads else ""
    if v.window:
        body += _WRITE_WINDOW
    body += f"""
  const int n_steps = {n_steps};
  for (int t0 = 0; t0 < n_steps; t0 += TC) {{
    const int tc = min(TC, n_steps - t0);
    __syncthreads();  // the previous chunk is fully consumed
"""
    if fused:
        body += (_LOAD_FUSED_STEPS if v.step_loads else _LOAD_FUSED) + _GATES_NORM
    else:
        body += _LOAD_PLAIN
    body += steps
    body += "  }\n"
    if record == "final":
        body += _WRITE_FINAL
    return body


def kernel_spec(**variant: Any) -> dict[str, Any]:
    """Arguments of ``mx.fast.cuda_kernel`` for one :class:`Variant` (given by its fields; names
    differ per variant)."""
    v = Variant(**variant)
    fused, joined, replay = v.fused, v.joined, v.replay
    if joined:
        inputs = ["conv_input", "conv_w", "a", "b", "A_log", "dt_bias", "state_in"]
    elif fused:
        inputs = ["conv_state", "qkv", "conv_w", "a", "b", "A_log", "dt_bias", "state_in"]
    else:
        inputs = ["q", "k", "v", "g", "beta", "state_in"]
    if replay:
        inputs.append("steps")
    outputs = (["y"] if v.write_y else []) + ["states" if v.record == "states" else "state_out"]
    outputs += ["window"] if v.window else []
    name = "hf2q_gdn_{}_{}{}{}{}{}{}".format(
        "fused" if fused else "steps",
        v.record,
        "_y" if v.write_y else "",
        "_replay" if replay else "",
        "_joined" if joined else "",
        "_w" if v.window else "",
        "_steploads" if v.step_loads else "",
    )
    return {
        "name": name,
        "input_names": inputs,
        "output_names": outputs,
        "source": _source(v),
        "header": _HEADER,
    }


@cache
def _built(v: Variant) -> Any:
    return mx.fast.cuda_kernel(**kernel_spec(**asdict(v)))


def _kernel(**variant: Any) -> Any:
    """The ``mx.fast.cuda_kernel`` of one :class:`Variant` (given by its fields), built once."""
    return _built(Variant(**variant))


class UnsupportedShape(ValueError):
    """The kernels cannot run these shapes; callers use the ops path instead."""


def warps_for(dv: int) -> int:
    """Warps per block: the largest of 4, 2, 1 whose ``8 * warps`` rows tile ``dv``."""
    for w in (4, 2, 1):
        if dv % (8 * w) == 0:
            return w
    raise UnsupportedShape(f"value head dim {dv} is not a multiple of 8")


def check_shapes(*, Dk: int, Dv: int, Hk: int, Hv: int, T: int) -> None:
    """Raise :class:`UnsupportedShape` unless the kernels support these sizes."""
    if Dk % 16 != 0 or not 16 <= Dk <= 256:
        raise UnsupportedShape(f"key head dim {Dk} must be a multiple of 16 in [16, 256]")
    warps_for(Dv)
    if Hv % Hk != 0:
        raise UnsupportedShape(f"{Hv} value heads are not a multiple of {Hk} key heads")
    if T < 1:
        raise UnsupportedShape("a block needs at least one step")


def _record_outputs(B: int, T: int, Hv: int, Dv: int, Dk: int, record: str) -> tuple:
    if record == "states":
        return (B, T, Hv, Dv, Dk)
    if record == "final":
        return (B, Hv, Dv, Dk)
    raise ValueError(f"record must be 'states' or 'final', not {record!r}")


def _launch(
    kern: Any,
    inputs: list,
    template: list,
    out_shapes: list,
    out_dtypes: list,
    grid: tuple,
    threads: int,
    verbose: bool,
) -> list:
    return kern(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=(threads, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=out_dtypes,
        verbose=verbose,
    )


def gated_delta_steps_cuda(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    record: str = "states",
    steps: int | mx.array | None = None,
    verbose: bool = False,
) -> tuple[mx.array, mx.array] | mx.array:
    """Gated delta rule over T steps on CUDA.

    Args:
        q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv); g, beta: (B, T, Hv) (g is the decay in linear
            space); state: (B, Hv, Dv, Dk) float32.
        record: ``"states"`` returns the state after every step (B, T, Hv, Dv, Dk) float32;
            ``"final"`` returns the state after the last step (B, Hv, Dv, Dk).
        steps: replay mode: run only the first ``steps`` steps (an int, or an int32 array of
            one count or of one count per batch row, (B,)) and return only the final state (no
            y). ``record`` must be "final".
        verbose: print the generated CUDA source (useful when it fails to compile).

    Returns:
        ``(y, states_or_final)``, y (B, T, Hv, Dv) in q's dtype; in replay mode the final state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    check_shapes(Dk=Dk, Dv=Dv, Hk=Hk, Hv=Hv, T=T)
    if state.dtype != mx.float32:
        raise UnsupportedShape("the recurrent state must be float32")
    replay = steps is not None
    if replay and record != "final":
        raise ValueError("replay (steps=...) returns the final state only: use record='final'")
    warps = warps_for(Dv)
    kern = _kernel(fused=False, record=record, write_y=not replay, replay=replay)
    inputs = [q, k, v, g, beta, state]
    if replay:
        inputs.append(_steps_array(steps, B))
    rec_shape = _record_outputs(B, T, Hv, Dv, Dk, record)
    out_shapes = ([] if replay else [(B, T, Hv, Dv)]) + [rec_shape]
    out_dtypes = ([] if replay else [q.dtype]) + [mx.float32]
    template = [
        ("InT", q.dtype),
        ("Dk", Dk),
        ("Dv", Dv),
        ("Hk", Hk),
        ("Hv", Hv),
        ("WARPS", warps),
        ("TC", MAX_CHUNK),
    ]
    rows = 8 * warps
    grid = (32 * warps * (Dv // rows), Hv, B)
    outs = _launch(kern, inputs, template, out_shapes, out_dtypes, grid, 32 * warps, verbose)
    return outs[0] if replay else (outs[0], outs[1])


def _steps_array(steps: int | mx.array, B: int) -> mx.array:
    """The replay's step count of each batch row, (B,) int32."""
    if not isinstance(steps, mx.array):
        return mx.full((B,), int(steps), dtype=mx.int32)
    steps = steps.astype(mx.int32)
    if steps.ndim != 1:  # (a reshape is a graph node even when it changes nothing)
        steps = steps.reshape(-1)
    if steps.size not in (1, B):
        raise ValueError(f"steps: one count or one per batch row ({B}), got {steps.size}")
    return mx.broadcast_to(steps, (B,)) if steps.size == 1 else steps


def gate_dtype(a: mx.array, dt_bias: mx.array) -> mx.Dtype:
    """Dtype of ``a + dt_bias`` under MLX's promotion (where mlx-lm's softplus input rounds)."""
    return (mx.zeros((1,), dtype=a.dtype) + mx.zeros((1,), dtype=dt_bias.dtype)).dtype


def _fused_template(
    dtype: Any, gate: Any, Hk: int, Dk: int, Hv: int, Dv: int, K: int, warps: int
) -> list:
    """The fused kernel's template arguments (model and gate dtypes, head geometry, conv size)."""
    return [
        ("InT", dtype),
        ("GT", gate),
        ("Dk", Dk),
        ("Dv", Dv),
        ("Hk", Hk),
        ("Hv", Hv),
        ("KC", K),
        ("WARPS", warps),
        ("TC", MAX_CHUNK),
    ]


def gdn_fused_cuda(
    conv_state: mx.array | None,
    qkv: mx.array,
    conv_w: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array,
    *,
    num_k_heads: int,
    key_dim: int,
    num_v_heads: int,
    value_dim: int,
    record: str = "states",
    steps: int | mx.array | None = None,
    window: bool = False,
    step_loads: bool = False,
    verbose: bool = False,
) -> tuple[mx.array, ...] | mx.array:
    """Conv + SiLU + q/k normalisation + gates + recurrence of one Gated-DeltaNet block on CUDA.

    Args:
        conv_state: (B, K-1, C) the conv rows before the block (C = 2*Hk*Dk + Hv*Dv), or None
            when ``qkv`` holds them: then ``qkv`` is the whole conv window (B, K-1+T, C) (a
            verify's record) and T comes from ``a``.
        qkv: (B, T, C) ``in_proj_qkv`` of the block.
        conv_w: (C, K) depthwise conv weight (mlx-lm's ``conv1d.weight`` is (C, K, 1)).
        a, b: (B, T, Hv) ``in_proj_a`` / ``in_proj_b`` of the block.
        A_log, dt_bias: (Hv,) the layer's parameters.
        state: (B, Hv, Dv, Dk) float32 recurrent state before the block.
        num_k_heads, key_dim, num_v_heads, value_dim: Hk, Dk, Hv, Dv.
        record, steps, verbose: as in :func:`gated_delta_steps_cuda`.
        window: also return the conv window ``concatenate([conv_state, qkv], axis=1)``
            (B, K-1+T, C), written by the same launch (not with ``steps`` or a joined read).
        step_loads: the conv read of the loads before session 48 (``Variant.step_loads``; same
            values), for timing and bit checks.

    Returns:
        ``(y, states_or_final)`` with y (B, T, Hv, Dv) in qkv's dtype (``window``: plus the conv
        window), or in replay mode the final state after ``steps`` steps.
    """
    joined = conv_state is None
    B, W, C = qkv.shape
    T = a.shape[1] if joined else W
    Hk, Dk, Hv, Dv = num_k_heads, key_dim, num_v_heads, value_dim
    check_shapes(Dk=Dk, Dv=Dv, Hk=Hk, Hv=Hv, T=T)
    if 2 * Hk * Dk + Hv * Dv != C:
        raise UnsupportedShape(f"qkv has {C} channels, expected {2 * Hk * Dk + Hv * Dv}")
    K = conv_w.shape[-1] if conv_w.ndim == 2 else conv_w.shape[1]
    if conv_w.ndim == 3:
        conv_w = conv_w.reshape(C, K)
    if joined and W != K - 1 + T:
        raise UnsupportedShape(f"a conv window of {W} rows for {T} steps (needs {K - 1 + T})")
    if not joined and conv_state.shape != (B, K - 1, C):
        raise UnsupportedShape(f"conv_state has shape {conv_state.shape}, expected {(B, K - 1, C)}")
    if state.dtype != mx.float32:
        raise UnsupportedShape("the recurrent state must be float32")
    replay = steps is not None
    if replay and record != "final":
        raise ValueError("replay (steps=...) returns the final state only: use record='final'")
    if window and (replay or joined):
        raise ValueError("window: a block's launch only (not a replay, not a joined read)")
    warps = warps_for(Dv)
    kern = _kernel(
        fused=True,
        record=record,
        write_y=not replay,
        replay=replay,
        joined=joined,
        window=window,
        step_loads=step_loads,
    )
    inputs = ([] if joined else [conv_state]) + [qkv, conv_w, a, b, A_log, dt_bias, state]
    if replay:
        inputs.append(_steps_array(steps, B))
    rec_shape = _record_outputs(B, T, Hv, Dv, Dk, record)
    out_shapes = ([] if replay else [(B, T, Hv, Dv)]) + [rec_shape]
    out_dtypes = ([] if replay else [qkv.dtype]) + [mx.float32]
    if window:
        out_shapes.append((B, K - 1 + T, C))
        out_dtypes.append(qkv.dtype)
    template = _fused_template(qkv.dtype, gate_dtype(a, dt_bias), Hk, Dk, Hv, Dv, K, warps)
    rows = 8 * warps
    grid = (32 * warps * (Dv // rows), Hv, B)
    outs = _launch(kern, inputs, template, out_shapes, out_dtypes, grid, 32 * warps, verbose)
    return outs[0] if replay else tuple(outs)


#: Per-layer inputs of the joined replay (the joined read's names), each suffixed ``_<layer>``.
_LAYER_INPUTS = ("conv_input", "conv_w", "a", "b", "A_log", "dt_bias", "state_in")


def replay_layers_spec(layers: int) -> dict[str, Any]:
    """Arguments of ``mx.fast.cuda_kernel`` replaying the final-state records of ``layers``
    Gated-DeltaNet layers in one launch (:func:`gdn_replay_layers_cuda`).

    The body is the joined replay's (:class:`Variant` fused, final, replay, joined) with the
    grid's z split into (layer, batch row): each thread block picks its layer's inputs and
    output by a switch, then runs exactly the per-layer kernel's code on them, so every state
    has the bits of that layer's own replay. Template ``NROWS``: batch rows.
    """
    v = Variant(fused=True, record="final", write_y=False, replay=True, joined=True)
    body = _source(v)
    bb_line = "  const int bb = blockIdx.z;\n"
    assert bb_line in body and "a_shape[1]" in body
    names = [*_LAYER_INPUTS, "state_out"]
    pick = "".join(f"  decltype({n}_0) {n} = {n}_0;\n" for n in names)
    cases = "".join(
        f"    case {i}: " + " ".join(f"{n} = {n}_{i};" for n in names) + " break;\n"
        for i in range(1, layers)
    )
    select_layer = (
        "  const int bb = blockIdx.z % NROWS;\n"
        "  const int layer = blockIdx.z / NROWS;\n"
        + pick
        + ("  switch (layer) {\n" + cases + "    default: break;\n  }\n" if cases else "")
    )
    body = body.replace(bb_line, select_layer).replace("a_shape[1]", "a_0_shape[1]")
    return {
        "name": f"hf2q_gdn_replay_layers_{layers}",
        "input_names": [f"{n}_{i}" for i in range(layers) for n in _LAYER_INPUTS] + ["steps"],
        "output_names": [f"state_out_{i}" for i in range(layers)],
        "source": body,
        "header": _HEADER,
    }


@cache
def _layers_kernel(layers: int) -> Any:
    """The joined replay's ``mx.fast.cuda_kernel`` for ``layers`` layers, built once."""
    return mx.fast.cuda_kernel(**replay_layers_spec(layers))


def gdn_replay_layers_cuda(
    layers: list[tuple[mx.array, ...]],
    steps: mx.array,
    *,
    num_k_heads: int,
    key_dim: int,
    num_v_heads: int,
    value_dim: int,
) -> list[mx.array]:
    """Every layer's final-state replay in one launch: per layer the state after each batch
    row's first ``steps[b]`` steps of its recorded block, the bits of
    ``gdn_fused_cuda(None, conv_input, conv_w, a, b, A_log, dt_bias, state, steps=steps)``.

    Args:
        layers: per layer ``(conv_input (B, K-1+T, C), conv_w (C, K), a (B, T, Hv), b,
            A_log (Hv,), dt_bias (Hv,), state (B, Hv, Dv, Dk) float32)``, every layer of the same
            shapes and dtypes (one head geometry, one block length).
        steps: int32 (B,), each row's kept count in ``1..T`` (unchecked, as the replay's).
        num_k_heads, key_dim, num_v_heads, value_dim: Hk, Dk, Hv, Dv.

    Returns:
        the replayed states (B, Hv, Dv, Dk) float32, per layer.

    Why: the per-layer replays are one launch and one graph node per layer (24 at the 4B
    shape), each a few hundred thread blocks that leave most of an H200 idle while they walk
    their steps; one launch runs every layer's blocks side by side.
    """
    L = len(layers)
    if L == 0:
        return []
    conv_input, conv_w, a, b, A_log, dt_bias, state = layers[0]
    B, W, C = conv_input.shape
    T = a.shape[1]
    Hk, Dk, Hv, Dv = num_k_heads, key_dim, num_v_heads, value_dim
    check_shapes(Dk=Dk, Dv=Dv, Hk=Hk, Hv=Hv, T=T)
    K = conv_w.shape[-1]
    if conv_w.ndim != 2 or W != K - 1 + T or 2 * Hk * Dk + Hv * Dv != C:
        raise UnsupportedShape(f"records {conv_input.shape} / {conv_w.shape} for {T} steps")
    first = [(x.shape, x.dtype) for x in layers[0]]
    if any(len(lay) != 7 or [(x.shape, x.dtype) for x in lay] != first for lay in layers):
        raise UnsupportedShape("layers of different shapes or dtypes")
    if state.dtype != mx.float32:
        raise UnsupportedShape("the recurrent state must be float32")
    warps = warps_for(Dv)
    template = _fused_template(conv_input.dtype, gate_dtype(a, dt_bias), Hk, Dk, Hv, Dv, K, warps)
    template.append(("NROWS", B))
    rows = 8 * warps
    return list(
        _layers_kernel(L)(
            inputs=[x for lay in layers for x in lay] + [_steps_array(steps, B)],
            template=template,
            grid=(32 * warps * (Dv // rows), Hv, B * L),
            threadgroup=(32 * warps, 1, 1),
            output_shapes=[(B, Hv, Dv, Dk)] * L,
            output_dtypes=[mx.float32] * L,
        )
    )
