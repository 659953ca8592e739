"""Judge a drafter by what it does at inference: tau from the real DFlash decoding loop.

What it does: run :func:`hf2q.runtime.dflash.measure_acceptance` (the generator ``hf2q
generate --dflash`` uses, on each prompt), greedy unless told otherwise, and report its pooled
statistics: tau = mean over all rounds of (a + 1), acceptance rate = sum(a) / sum(B - 1).
The drafter is evaluated in the dtype it will run in (the target's), from a copy of the weights
being trained.

What it does not do: decode by itself, or estimate acceptance from training accuracy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from hf2q.runtime.drafter import DFlashDraftModel


@dataclass
class TauResult:
    """Pooled DFlash statistics over several prompts."""

    tau: float  # mean over rounds of (a + 1)
    acceptance_rate: float  # sum(a) / sum(B - 1)
    rounds: int
    prompts: int
    generated_tokens: int
    seconds: float
    per_prompt_tau: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def inference_copy(drafter: DFlashDraftModel, target: Any) -> DFlashDraftModel:
    """A copy of ``drafter`` in the target's dtype, bound to the target, in eval mode."""
    from mlx.utils import tree_flatten

    dtype = target.dtype
    copy = DFlashDraftModel(drafter.config)
    copy.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(drafter.parameters())])
    copy.eval()
    copy.bind(target.embed, target.head)
    mx.eval(copy.parameters())
    return copy


def measure_tau(
    target: Any,
    drafter: DFlashDraftModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
    block_size: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> TauResult:
    """Generate from every prompt with DFlash and pool the round statistics.

    Args:
        drafter: bound to ``target`` and in its dtype (see :func:`inference_copy`).
        prompts: token ids; max_tokens: generated tokens per prompt.
    """
    from hf2q.runtime.dflash import measure_acceptance
    from hf2q.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=seed if temperature > 0 else None)
    t0 = time.perf_counter()
    stats = measure_acceptance(
        target,
        drafter,
        prompts,
        max_tokens=max_tokens,
        block_size=block_size,
        sampling=sampling,
        eos_token_ids=eos_token_ids,
    )
    return TauResult(
        tau=stats.tau if stats.rounds else float("nan"),
        acceptance_rate=stats.acceptance_rate if stats.drafted else float("nan"),
        rounds=stats.rounds,
        prompts=len(prompts),
        generated_tokens=stats.tokens,
        seconds=time.perf_counter() - t0,
        per_prompt_tau=stats.per_prompt_tau,
        outputs=stats.outputs,
    )
