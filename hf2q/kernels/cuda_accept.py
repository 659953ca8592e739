"""Greedy acceptance of a DFlash round in one CUDA launch (``mx.fast.cuda_kernel``).

Why: at temperature 0 a round's acceptance is ops over tiny integer arrays
(:func:`hf2q.runtime.sampling.accept_greedy`: the cast of the target's argmax, the match, the row
limits, a cumulative product, a sum, a gather) and the kept counts after it (``a + 1``): about
ten graph nodes of a few microseconds each. A one-slot round of the 4B-shaped pair waits for the
host, about 13 us of host work a node (session 57's H100 trace); one launch computes them all.

What it does: :func:`accept_greedy_cuda` takes the drafts (R, n), the target's argmax at the
verify positions (R, n+1, as ``mx.argmax`` gives it) and each row's limit (R,), and returns the
accepted count ``a`` (leading drafts equal to the target's choice, at most the limit), the bonus
token (the target's choice at position ``a``) and the kept count ``a + 1``, all int32 (R,): the
values of ``accept_greedy`` (integers: the same, whatever the device); and the drafter's next
block (the bonus token, then mask tokens), which a lagged round otherwise joins with a
concatenate (two copy launches). One thread a row.

What it does not do: sampled acceptance (rejection sampling stays ops), or run off CUDA (the ops
there).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from hf2q.kernels.cuda_rollback import compiled_on_cuda

_SOURCE = r"""
  const int R = draft_shape[0];
  const int n = draft_shape[1];
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < R) {
    const int most = min(n, (int)limit[r]);
    int a = 0;
    while (a < most && (int)draft[(size_t)r * n + a] == (int)choice[(size_t)r * (n + 1) + a]) {
      ++a;
    }
    const int b = (int)choice[(size_t)r * (n + 1) + a];
    accepted[r] = a;
    bonus[r] = b;
    keep[r] = a + 1;
    // the drafter's next block: the bonus token, then the mask token
    block[(size_t)r * (n + 1)] = b;
    for (int i = 1; i <= n; ++i) block[(size_t)r * (n + 1) + i] = MASK;
  }
"""


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="hf2q_accept_greedy",
        input_names=["draft", "choice", "limit"],
        output_names=["accepted", "bonus", "keep", "block"],
        source=_SOURCE,
    )


def _launch(draft: mx.array, choice: mx.array, limit: mx.array, mask: int) -> list[mx.array]:
    R, n = draft.shape
    block = min(-(-R // 32) * 32, 256)  # one thread a row, in whole warps
    return _kernel()(
        inputs=[draft, choice, limit],
        template=[("MASK", mask)],
        grid=(-(-R // block) * block, 1, 1),
        threadgroup=(block, 1, 1),
        output_shapes=[(R,)] * 3 + [(R, n + 1)],
        output_dtypes=[mx.int32] * 4,
    )


@cache
def _launcher(mask: int) -> Any:
    """The launch for one mask token, compiled on CUDA (a kernel called from Python each round:
    see :func:`~hf2q.kernels.cuda_rollback.compiled_on_cuda`); plain in the CPU tests' emulator."""
    return compiled_on_cuda(lambda draft, choice, limit: _launch(draft, choice, limit, mask))


def accept_greedy_cuda(
    draft: mx.array, choice: mx.array, limit: mx.array, mask: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``(a, bonus, keep, block)`` of drafts ``draft`` (R, n) against the target's argmax
    ``choice`` (R, n+1; any integer dtype) with at most ``limit[r]`` (R,) accepted in row r:
    (R,) int32 each, and the drafter's next block (R, n+1) int32, the bonus token then n of
    ``mask`` (its mask token)."""
    R, n = draft.shape
    if choice.shape != (R, n + 1) or limit.shape != (R,):
        raise ValueError(f"drafts {draft.shape}, choices {choice.shape}, limits {limit.shape}")
    a, bonus, keep, block = _launcher(int(mask))(
        draft.astype(mx.int32), choice, limit.astype(mx.int32)
    )
    return a, bonus, keep, block


__all__ = ["accept_greedy_cuda"]
