"""The Gated-DeltaNet recurrence that also returns the state after every step (for exact rollback).

What it does: run the gated delta rule of Qwen3.5's linear-attention layers over T steps and
return the outputs *and* the recurrent state after each step, so a speculative verify can later
restore the state after any accepted prefix without running the target again.

The arithmetic per step is exactly mlx-lm's ops reference (``mlx_lm.models.gated_delta``,
``_gated_delta_step_ops``: decay, read, delta, write, read-out, in that order), so on the same
inputs the outputs and final state equal mlx-lm's ``gated_delta_ops`` bit for bit; a test pins it.

What it does not do: project inputs, normalise q/k, compute ``g``/``beta`` (callers use mlx-lm's
``normalize_qk`` / ``compute_g``), or know about caches. A fused GPU kernel with the same
signature may be added here later; :func:`gated_delta_steps` is the contract it must meet.

Why a list of per-step states rather than one (B, T, ...) array: on the ops path every step's
state is materialised anyway, so keeping references costs nothing, while stacking them would copy
T states per layer per verify (measured: about 1.3 ms of an 11 ms verify on a tiny CPU model). A
fused kernel that writes one (B, T, Hv, Dv, Dk) buffer meets the contract by returning
``[buf[:, t] for t in range(T)]`` (views, no copy).
"""

from __future__ import annotations

import mlx.core as mx


def gated_delta_steps(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, list[mx.array]]:
    """Gated delta rule over T steps, returning every intermediate state.

    The contract is :func:`gated_delta_steps_reference` (same arguments, shapes, dtypes and
    results). This entry point runs it through ``mx.compile``, which replays the traced graph
    per input shape instead of rebuilding T steps of small ops in Python each call (about 3x
    faster on CPU for small models; bit-identical results on CPU, tested).

    Returns:
        ``(y, states)`` as :func:`gated_delta_steps_reference`.
    """
    if mask is None:
        from hf2q.kernels.select import recurrence_impl

        if recurrence_impl(q, v, state) == "cuda":
            from hf2q.kernels.cuda_gated_delta import gated_delta_steps_cuda

            y, buf = gated_delta_steps_cuda(q, k, v, g, beta, state, record="states")
            return y, [buf[:, t] for t in range(q.shape[1])]  # views of one buffer
    out = (
        _compiled(q, k, v, g, beta, state)
        if mask is None
        else _compiled_masked(q, k, v, g, beta, state, mask)
    )
    return out[0], list(out[1:])


def gated_delta_steps_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, list[mx.array]]:
    """Ops reference of :func:`gated_delta_steps`: a Python loop of small MLX ops per step.

    Per step t and value head h (``kh`` = the key head that h reads, ``h // (Hv // Hk)``)::

        S = S * g[t, h]                        # decay
        kv = S @ k[t, kh]                      # (Dv,)   read with the key
        delta = (v[t, h] - kv) * beta[t, h]
        S = S + outer(delta, k[t, kh])         # write
        y[t, h] = S @ q[t, kh]                 # read-out (q carries the Dk**-0.5 scale)

    Args:
        q: (B, T, Hk, Dk) queries, already normalised with ``normalize_qk``.
        k: (B, T, Hk, Dk) keys, already normalised.
        v: (B, T, Hv, Dv) values. ``Hv`` must be a multiple of ``Hk``.
        g: (B, T, Hv) float32 decay in (0, 1] (scalar gating), from ``compute_g``.
        beta: (B, T, Hv) write strength, ``sigmoid(b)``.
        state: (B, Hv, Dv, Dk) float32 state before step 0.
        mask: optional (B, T) bool; where False the state is carried over unchanged (padding).

    Returns:
        ``(y, states)``: y (B, T, Hv, Dv) in ``q.dtype``; states a list of T float32 arrays
        (B, Hv, Dv, Dk), ``states[t]`` = the state after step t (``states[-1]`` the final state).
    """
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if (rep := Hv // Hk) > 1:
        q = mx.repeat(q, rep, -2)
        k = mx.repeat(k, rep, -2)
    ys = []
    states = []
    for t in range(T):
        y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, mask, t)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


def _flat(*args: mx.array) -> tuple[mx.array, ...]:
    # mx.compile returns flat tuples of arrays: (y, state_0, ..., state_{T-1}).
    y, states = gated_delta_steps_reference(*args)
    return (y, *states)


_compiled = mx.compile(_flat)
_compiled_masked = mx.compile(_flat)


def _step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None,
    t: int,
) -> tuple[mx.array, mx.array]:
    # q, k: (B, Hv, Dk); v: (B, Hv, Dv); g, beta: (B, Hv); state: (B, Hv, Dv, Dk)
    old = state
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # (B, Hv, Dv)
    delta = (v - kv_mem) * beta[..., None]  # (B, Hv, Dv)
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # (B, Hv, Dv)
    if mask is not None:
        state = mx.where(mask[:, t, None, None, None], state, old)
    return y.astype(q.dtype), state
