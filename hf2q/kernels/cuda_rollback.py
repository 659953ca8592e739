"""Rollback of every Gated-DeltaNet layer of a verify in one CUDA launch (``mx.fast.cuda_kernel``).

What it does: after a verify of T positions each Gated-DeltaNet layer holds a record (the conv
input window ``(B, K-1+T, C)`` and the float32 state after every position ``(B, T, Hv, Dv, Dk)``,
what the fused kernel writes); keeping the first ``n_b`` positions of batch row b means taking
the conv rows ``n_b .. n_b+K-2`` and the state after position ``n_b``. With ops that is a slice,
a squeeze and a contiguous copy per layer (a gather and its index arithmetic per layer for ragged
rows): five graph nodes or more per layer, about 120 for a 4B-shaped target, each costing the host
a few microseconds to encode on an H200 while the copies themselves are tiny.
:func:`rollback_cuda` copies the kept conv rows and states of all layers in one launch: one graph
node. The kept counts are an int32 array (B,), so the same compiled kernel serves every round.
Records that keep only the final state (``hf2q.kernels.select.gdn_record``) are restored by a
replay per layer; :func:`rollback_conv_cuda` copies their kept conv rows, all layers in one
launch as well (a gather and its index arithmetic per layer otherwise).

What it does not do: decide acceptance, trim attention caches (that is an offset change), or run
anywhere but an NVIDIA GPU (``hf2q.runtime.cache`` keeps the ops path elsewhere). Its copies are
bit-exact, so results equal the ops rollback bit for bit.

Layout: grid (x: enough threads for the larger of one row's state in float4 and one row's kept
conv elements, y: batch row, z: layer); each thread copies one float4 of the state and one conv
element of its row and layer. The layer's pointers come from a switch generated for the number of
layers (one compiled kernel per layer count, dtype and shape).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx

from hf2q.kernels import select

#: Threads per block.
THREADS = 256


def _source(layers: int, states: bool = True) -> str:
    if states:
        cases = "\n".join(
            f"    case {i}: cs = c{i}; ss = s{i}; cd = oc{i}; sd = os{i}; break;"
            for i in range(layers)
        )
        state_vars = "const float* ss = nullptr; float* sd = nullptr;"
        state_copy = """
  if (i < S4) {
    const float4* src = reinterpret_cast<const float4*>(ss) + ((size_t)b * T + (n - 1)) * S4;
    reinterpret_cast<float4*>(sd)[(size_t)b * S4 + i] = src[i];
  }"""
    else:
        cases = "\n".join(f"    case {i}: cs = c{i}; cd = oc{i}; break;" for i in range(layers))
        state_vars, state_copy = "", ""
    return f"""
  const unsigned b = blockIdx.y;
  const unsigned i = blockIdx.x * NT + threadIdx.x;
  const int n = keep[b];  // positions kept in this row, 1..T
  const CT* cs = nullptr; CT* cd = nullptr; {state_vars}
  switch (blockIdx.z) {{
{cases}
    default: return;
  }}{state_copy}
  if (i < K1 * C) {{
    cd[(size_t)b * K1 * C + i] = cs[((size_t)b * (K1 + T) + n) * C + i];
  }}
"""


def spec(layers: int, states: bool = True) -> tuple[str, list[str], list[str], str]:
    """(name, input names, output names, source) of the kernel for ``layers`` layers (the CPU
    tests build the same in their emulator); ``states=False``: the conv rows only (records that
    keep the final state, whose rollback replays the kept steps instead of copying a state)."""
    ins = [f"c{i}" for i in range(layers)]
    outs = [f"oc{i}" for i in range(layers)]
    if states:
        ins += [f"s{i}" for i in range(layers)]
        outs += [f"os{i}" for i in range(layers)]
    name = f"hf2q_gdn_rollback_{layers}" if states else f"hf2q_gdn_conv_rollback_{layers}"
    return name, [*ins, "keep"], outs, _source(layers, states)


@cache
def _kernel(layers: int, states: bool = True) -> Any:
    name, ins, outs, source = spec(layers, states)
    return mx.fast.cuda_kernel(name=name, input_names=ins, output_names=outs, source=source)


def supported(convs: list[mx.array], states: list[mx.array], keep: mx.array) -> str | None:
    """Why :func:`rollback_cuda` cannot restore these records (None when it can)."""
    if not convs or len(convs) != len(states):
        return f"{len(convs)} conv records for {len(states)} state records"
    c0, s0 = convs[0], states[0]
    if c0.ndim != 3 or s0.ndim < 3:
        return f"records of shapes {c0.shape} / {s0.shape}"
    B, T = s0.shape[0], s0.shape[1]
    if any(c.shape != c0.shape or c.dtype != c0.dtype for c in convs):
        return "conv records of different shapes or dtypes"
    if any(s.shape != s0.shape or s.dtype != mx.float32 for s in states):
        return "state records of different shapes, or not float32"
    if c0.shape[0] != B or c0.shape[1] <= T:
        return f"conv record {c0.shape} does not hold the {T} verified positions of {B} rows"
    per_row = 1
    for d in s0.shape[2:]:
        per_row *= d
    if per_row % 4:
        return f"a state of {per_row} floats is not a whole number of float4"
    if keep.shape != (B,) or keep.dtype != mx.int32:
        return f"kept counts {keep.shape} {keep.dtype} (needs int32 ({B},))"
    return None


def rollback_cuda(
    convs: list[mx.array], states: list[mx.array], keep: mx.array
) -> tuple[list[mx.array], list[mx.array]]:
    """The conv states and recurrent states after each row's kept positions, all layers at once.

    Args:
        convs: per layer the conv input window (B, K-1+T, C) of the verify.
        states: per layer the float32 state after every verified position (B, T, ...).
        keep: int32 (B,), positions kept per batch row, each in ``1..T`` (not checked here:
            callers validate the counts before they become an array).

    Returns:
        (conv states (B, K-1, C) in the records' dtype, states (B, ...) float32), per layer.
    """
    L = len(convs)
    outs = _launcher(L)(*convs, *states, keep)
    return list(outs[:L]), list(outs[L:])


def rollback_conv_cuda(convs: list[mx.array], keep: mx.array, steps: int) -> list[mx.array]:
    """The conv states after each row's kept positions, all layers in one launch: what
    :func:`rollback_cuda` copies for records that hold no per-step states (the final-state
    record, whose states a replay restores).

    Args:
        convs: per layer the conv input window (B, K-1+steps, C) of a verify of ``steps``
            positions (same shapes and dtype in every layer).
        keep: int32 (B,), positions kept per batch row, each in ``1..steps`` (unchecked).

    Returns:
        conv states (B, K-1, C) in the records' dtype, per layer.
    """
    return list(_conv_launcher(len(convs), steps)(*convs, keep))


def conv_supported(convs: list[mx.array], keep: mx.array, steps: int) -> str | None:
    """Why :func:`rollback_conv_cuda` cannot restore these conv records (None when it can)."""
    if not convs:
        return "no conv records"
    c0 = convs[0]
    if c0.ndim != 3 or any(c.shape != c0.shape or c.dtype != c0.dtype for c in convs):
        return "conv records of different shapes or dtypes"
    if not 0 < steps < c0.shape[1]:
        return f"conv record {c0.shape} does not hold {steps} verified positions"
    if keep.shape != (c0.shape[0],) or keep.dtype != mx.int32:
        return f"kept counts {keep.shape} {keep.dtype} (needs int32 ({c0.shape[0]},))"
    return None


@cache
def _conv_launcher(layers: int, steps: int) -> Callable[..., list[mx.array]]:
    """:func:`_launcher` for the conv rows only, ``steps`` verified positions."""

    def launch(*arrays: mx.array) -> list[mx.array]:
        return _launch(list(arrays[:layers]), [], arrays[-1], steps)

    return compiled_on_cuda(launch)


@cache
def _launcher(layers: int) -> Callable[..., list[mx.array]]:
    """The launch for ``layers`` layers (T from the state records' shape)."""

    def launch(*arrays: mx.array) -> list[mx.array]:
        states = list(arrays[layers : 2 * layers])
        return _launch(list(arrays[:layers]), states, arrays[-1], states[0].shape[1])

    return compiled_on_cuda(launch)


def compiled_on_cuda(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` ``mx.compile``'d on CUDA: MLX builds a custom kernel's source text and
    signature (here about a hundred parameters) on every call of its Python function, about
    0.4 ms at the 4B shape (``benchmarks/rollback_cost.py``); a compiled trace replays the kernel
    node instead. Elsewhere (the CPU tests' emulator) the plain function."""
    return mx.compile(launch) if select.backend() == "cuda" else launch


def _launch(
    convs: list[mx.array], states: list[mx.array], keep: mx.array, T: int
) -> list[mx.array]:
    """One launch over every layer: the kept conv rows, and the kept states where ``states``
    are given (none: the conv-only kernel)."""
    L = len(convs)
    B, W, C = convs[0].shape
    K1 = W - T
    state_shape = states[0].shape[2:] if states else ()
    S4 = math.prod(state_shape) // 4 if states else 0
    template = [("CT", convs[0].dtype), ("T", T), ("K1", K1), ("C", C)]
    template += [("S4", S4)] if states else []
    return _kernel(L, bool(states))(
        inputs=[*convs, *states, keep],
        template=[*template, ("NT", THREADS)],
        grid=(-(-max(S4, K1 * C) // THREADS) * THREADS, B, L),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, K1, C)] * L + [(B, *state_shape)] * len(states),
        output_dtypes=[convs[0].dtype] * L + [mx.float32] * len(states),
    )
