"""The ``hf2q bench`` measurement: batched DFlash against its baselines, per slot count.

What it does: for each slot count N, decode the same N requests three ways and time them:

- ``plain``: batched plain decoding, N rows, one token per row per step
  (:func:`hf2q.runtime.slots.slots_plain_generate`);
- ``dflash-seq``: single-sequence DFlash (:func:`hf2q.runtime.dflash.dflash_generate`) run on
  the N requests one after another;
- ``dflash``: batched DFlash with N slots (:func:`hf2q.runtime.slots.slots_dflash_generate`).

Each measured trial follows ``warmup`` unrecorded runs; figures are medians over trials with
their min and max. Generation tok/s excludes prefill (tokens after each request's first over the
decode time); round efficiency ``E = t(one plain decode step) / t(one DFlash round)`` compares the
two at the same N (so the DFlash speedup over plain is ``tau * E``). The result is a JSON-ready
dict (see :func:`run_bench`); at T = 0 the bench also checks that DFlash produced exactly the
plain tokens (``matches_plain``).

What it does not do: load models, print or render (``hf2q.cli.bench``), or sample (T = 0 only).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx

from hf2q.errors import UsageError
from hf2q.platform import HOST_LOOP_ADDS, host_loop_ms

WORKLOADS = ("prompts", "random")
MODES = ("plain", "dflash-seq", "dflash")
#: Version of the JSON layout written by ``hf2q bench --json``.
SCHEMA = 1

#: The built-in prompt set (``--workload prompts``): slot i gets prompt i modulo this list, so
#: slots hold prompts of different lengths and stop at different times.
BUILTIN_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'import os\nimport sys\n\n\ndef main(argv):\n    """Print every file below the given folder."""\n',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "Explain in three sentences why the sky is blue.",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "What is 17 * 23? Show the steps.",
    "def parse_args(args=None):\n    parser = argparse.ArgumentParser(description=",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; see ``hf2q bench --help`` for each option."""

    slots: tuple[int, ...] = (1, 2, 4, 8)
    gen_tokens: int = 128
    prompt_tokens: int | None = None  # random workload only (default 128)
    trials: int = 3
    warmup: int = 1
    block_size: int | None = None
    workload: str = "prompts"
    baseline: bool = True
    seed: int = 0
    idle: str = "compact"
    requests_per_slot: int = 1  # K: N slots decode K x N requests (K > 1: continuous batching)
    lookup: bool = True  # DFlash rounds may draft by n-gram lookup (hf2q.runtime.lookup)

    def validate(self) -> BenchConfig:
        """Raise :class:`UsageError` naming the bad option; return self."""
        if not self.slots or any(n < 1 for n in self.slots):
            raise UsageError(f"--slots needs counts of at least 1, got {list(self.slots)}")
        if self.gen_tokens < 2:
            raise UsageError(
                f"--gen-tokens must be at least 2 (the first token is prefill), got {self.gen_tokens}"
            )
        if self.trials < 1:
            raise UsageError(f"--trials must be at least 1, got {self.trials}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.workload not in WORKLOADS:
            raise UsageError(
                f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        if self.prompt_tokens is not None:
            if self.workload != "random":
                raise UsageError(
                    "--prompt-tokens applies to --workload random (the built-in prompts keep "
                    "their own lengths): drop it or add --workload random"
                )
            if self.prompt_tokens < 1:
                raise UsageError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}")
        if self.block_size is not None and self.block_size < 2:
            raise UsageError(f"--block-size must be at least 2, got {self.block_size}")
        from hf2q.runtime.slots import IDLE_POLICIES

        if self.idle not in IDLE_POLICIES:
            raise UsageError(f"--idle must be one of {', '.join(IDLE_POLICIES)}, got {self.idle!r}")
        if self.requests_per_slot < 1:
            raise UsageError(
                f"--requests-per-slot must be at least 1, got {self.requests_per_slot}"
            )
        return self


def parse_slots(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` or ``"4"`` -> sorted distinct counts; raise :class:`UsageError` otherwise."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise UsageError(
            f"--slots takes a count or a comma-separated list like 1,2,4,8, got {text!r}"
        ) from None
    if not counts or any(n < 1 for n in counts):
        raise UsageError(f"--slots needs counts of at least 1, like 1,2,4,8, got {text!r}")
    return tuple(sorted(set(counts)))


# ---- workload -----------------------------------------------------------------------------------
def make_prompts(
    config: BenchConfig,
    n: int,
    *,
    tokenizer: Any = None,
    chat: bool = False,
    vocab_size: int | None = None,
    avoid: Sequence[int] = (),
) -> list[list[int]]:
    """The ``n`` prompts (token ids) of the configured workload.

    ``prompts``: the built-in texts through ``tokenizer`` (chat template when ``chat``).
    ``random``: ``prompt_tokens`` ids drawn uniformly (seeded) from the tokenizer's ids
    (or ``vocab_size``), never one of ``avoid`` (stop / special tokens).
    """
    if config.workload == "prompts":
        if tokenizer is None:
            raise UsageError(
                "--workload prompts needs the model's tokenizer: use --workload random"
            )
        from hf2q.runtime.pair import encode_prompt

        return [
            encode_prompt(tokenizer, BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)], chat=chat)
            for i in range(n)
        ]
    import numpy as np

    high = vocab_size
    if tokenizer is not None:
        high = min(high or len(tokenizer.vocab), len(tokenizer.vocab))
    if not high:
        raise UsageError("--workload random needs a vocabulary size")
    bad = np.array(sorted(set(int(a) for a in avoid)), dtype=np.int64)
    rng = np.random.default_rng(config.seed)
    length = config.prompt_tokens or 128
    prompts = []
    for _ in range(n):
        ids = rng.integers(0, high, size=length)
        while bad.size and np.isin(ids, bad).any():
            hit = np.isin(ids, bad)
            ids[hit] = rng.integers(0, high, size=int(hit.sum()))
        prompts.append([int(i) for i in ids])
    return prompts


# ---- one measured run ---------------------------------------------------------------------------
@dataclass
class RunResult:
    """What one run of one mode at one slot count measured."""

    tokens_per_s: float
    per_slot_tokens_per_s: list[float]
    prefill_tokens_per_s: float
    round_s: float  # mean seconds per round (plain: per step)
    draft_s: float | None
    verify_s: float | None
    rollback_s: float | None
    rounds: int
    busy_rows: float  # mean requests decoding per round (1 for single-sequence runs)
    generation_tokens: int
    peak_memory_gb: float
    tau: float | None
    tau_per_slot: list[float | None] | None
    accepted_histogram_per_slot: list[list[int]] | None
    acceptance_rate: float | None
    tokens: list[list[int]]  # per request, for the lossless check
    lookup_share: float | None = None  # of the requests' DFlash rounds, those lookup drafted


def _run_slots_mode(
    mode: str,
    target: Any,
    drafter: Any,
    prompts: list[list[int]],
    config: BenchConfig,
    eos: frozenset[int],
    n: int,
) -> RunResult:
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate, slots_plain_generate

    reqs = [Request(p, max_tokens=config.gen_tokens) for p in prompts]
    if mode == "plain":
        events = slots_plain_generate(target, reqs, slots=n, eos_token_ids=eos, idle=config.idle)
    else:
        events = slots_dflash_generate(
            target,
            drafter,
            reqs,
            slots=n,
            block_size=config.block_size,
            eos_token_ids=eos,
            idle=config.idle,
            lookup=config.lookup,
        )
    s = run_slots(events)
    rounds = max(s.rounds, 1)
    dflash = mode == "dflash"
    return RunResult(
        tokens_per_s=s.generation_tps,
        per_slot_tokens_per_s=[x.generation_tps for x in s.per_slot],
        prefill_tokens_per_s=s.prompt_tps,
        round_s=s.decode_time / rounds,
        draft_s=s.t_draft / rounds if dflash else None,
        verify_s=s.t_verify / rounds if dflash else None,
        rollback_s=s.t_rollback / rounds if dflash else None,
        rounds=s.rounds,
        busy_rows=s.row_rounds / rounds,
        generation_tokens=s.generation_tokens,
        peak_memory_gb=s.peak_memory_gb,
        tau=s.tau,
        tau_per_slot=[x.tau for x in s.per_slot] if dflash else None,
        accepted_histogram_per_slot=[x.accepted_histogram for x in s.per_slot] if dflash else None,
        acceptance_rate=s.acceptance_rate,
        tokens=[r.tokens for r in s.requests],
        lookup_share=_lookup_share(s.requests) if dflash else None,
    )


def _lookup_share(sums: Sequence[Any]) -> float | None:
    """Share of the requests' DFlash rounds drafted by lookup (None when lookup was off)."""
    if any(x.lookup_rounds is None for x in sums):
        return None
    rounds = sum(x.rounds or 0 for x in sums)
    return sum(x.lookup_rounds for x in sums) / rounds if rounds else 0.0


def _run_sequential(
    target: Any,
    drafter: Any,
    prompts: list[list[int]],
    config: BenchConfig,
    eos: frozenset[int],
    n: int,
) -> RunResult:
    from hf2q.runtime.dflash import (
        Summary,
        dflash_generate,
        pooled_acceptance,
        run,
        tokens_per_s,
    )

    sums: list[Summary] = [
        run(
            dflash_generate(
                target,
                drafter,
                p,
                max_tokens=config.gen_tokens,
                block_size=config.block_size,
                eos_token_ids=eos,
                lookup=config.lookup,
            )
        )
        for p in prompts
    ]
    sum_a = sum(s.accepted or 0 for s in sums)
    drafted = sum(s.drafted or 0 for s in sums)
    decode = sum(s.decode_time for s in sums)
    prefill = sum(s.prefill_time for s in sums)
    rounds = sum(s.rounds or 0 for s in sums)
    r = max(rounds, 1)
    tau, rate, _ = pooled_acceptance(sum_a, rounds, drafted)
    # Nominal "slot" j of the sequential baseline: requests j, j + n, ... (with one request per
    # slot, request j; with a queue the batched runs give a queued request to whichever slot
    # frees first, so per-slot figures compare across modes only with one request per slot).
    groups = [sums[j::n] for j in range(n)]
    return RunResult(
        tokens_per_s=sum(s.generation_tokens - 1 for s in sums) / decode if decode > 0 else 0.0,
        per_slot_tokens_per_s=[
            tokens_per_s(sum(s.generation_tokens - 1 for s in g), sum(s.decode_time for s in g))
            for g in groups
        ],
        prefill_tokens_per_s=sum(s.prompt_tokens for s in sums) / prefill if prefill else 0.0,
        round_s=decode / r,
        draft_s=sum(s.t_draft or 0 for s in sums) / r,
        verify_s=sum(s.t_verify or 0 for s in sums) / r,
        rollback_s=sum(s.t_rollback or 0 for s in sums) / r,
        rounds=rounds,
        busy_rows=1.0,
        lookup_share=_lookup_share(sums),
        generation_tokens=sum(s.generation_tokens for s in sums),
        peak_memory_gb=max(s.peak_memory_gb for s in sums),
        tau=tau,
        tau_per_slot=[
            pooled_acceptance(
                sum(s.accepted or 0 for s in g),
                sum(s.rounds or 0 for s in g),
                sum(s.drafted or 0 for s in g),
            )[0]
            for g in groups
        ],
        accepted_histogram_per_slot=[
            [sum(h) for h in zip(*(s.accepted_histogram or [] for s in g))] for g in groups
        ],
        acceptance_rate=rate,
        tokens=[s.tokens for s in sums],
    )


# ---- the whole bench ----------------------------------------------------------------------------
def _stats(values: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 4)


def _rnd(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def run_bench(
    target: Any,
    drafter: Any,
    config: BenchConfig,
    *,
    tokenizer: Any = None,
    chat: bool = False,
    eos_token_ids: Sequence[int] = (),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every mode at every slot count; return the JSON-ready report.

    Args:
        target: a ``TargetModel``; ``drafter``: a DFlash drafter bound to it.
        config: what to measure (validated here).
        tokenizer: encodes the built-in prompts (``--workload prompts``).
        chat: apply the chat template to the built-in prompts.
        eos_token_ids: stop tokens for ``prompts``; ignored by the ``random`` workload, whose
            requests always generate ``gen_tokens`` tokens.
        progress: called with a short description before each run (for a status line).

    Returns:
        ``{"schema", "config", "dtype", "host", "results": [row, ...]}`` (``host``: how long
        a loop of :data:`~hf2q.platform.HOST_LOOP_ADDS` Python additions took before and after
        the runs); one row per (slots, mode) with
        ``slots``, ``mode``, ``tokens_per_s`` (median; ``_min`` / ``_max``), ``per_slot_tokens_per_s``,
        ``prefill_tokens_per_s``, ``tau``, ``tau_per_slot``, ``accepted_histogram_per_slot``,
        ``round_ms`` (median; ``_min`` / ``_max``), ``draft_ms``, ``verify_ms``, ``rollback_ms``,
        ``E``, ``speedup_vs_plain``, ``scaling_vs_1_slot``, ``peak_memory_gb``, ``rounds``,
        ``busy_rows`` (mean requests decoding per round: below ``slots`` when some requests
        finish early and the batch runs on for the rest), ``lookup_share`` (DFlash rows: the
        share of rounds drafted by n-gram lookup, None with ``lookup`` off), ``generation_tokens``,
        ``matches_plain`` and ``trials``.
    """
    config.validate()
    B = config.block_size or drafter.block_size
    if drafter.block_size < B:
        raise UsageError(
            f"--block-size {B} is above the drafter's block size {drafter.block_size}: "
            f"pass at most {drafter.block_size}"
        )
    eos = frozenset() if config.workload == "random" else frozenset(int(e) for e in eos_token_ids)
    avoid = set(eos_token_ids) | {drafter.mask_token_id}
    if tokenizer is not None:
        avoid |= set(getattr(tokenizer, "all_special_ids", []) or [])
    modes = MODES if config.baseline else ("dflash",)
    prompts = {
        N: make_prompts(
            config,
            N * config.requests_per_slot,
            tokenizer=tokenizer,
            chat=chat,
            vocab_size=target.vocab_size,
            avoid=sorted(avoid),
        )
        for N in config.slots
    }
    runs: dict[int, dict[str, list[RunResult]]] = {N: {m: [] for m in modes} for N in config.slots}
    host_before = host_loop_ms()

    def one(N: int, mode: str, what: str) -> RunResult:
        if progress is not None:
            progress(f"{N} slot{'s' if N > 1 else ''}, {mode}, {what}")
        mx.clear_cache()
        if mode == "dflash-seq":
            return _run_sequential(target, drafter, prompts[N], config, eos, N)
        return _run_slots_mode(mode, target, drafter, prompts[N], config, eos, N)

    # Every warm-up first, then the trials round-robin over the slot counts and modes: a
    # machine that speeds up or slows down during the run (clocks, a neighbour) shifts every
    # row alike instead of the slot counts measured last, so the ratios between rows (scaling
    # over one slot, speedup over plain) compare runs made side by side.
    for N in config.slots:
        for _ in range(config.warmup):
            for mode in modes:
                one(N, mode, "warm-up")
    for trial in range(config.trials):
        for N in config.slots:
            for mode in modes:
                runs[N][mode].append(one(N, mode, f"trial {trial + 1}/{config.trials}"))
    rows: list[dict[str, Any]] = []
    for N in config.slots:
        rows.extend(_rows_for(N, runs[N], B))
    _relate(rows)
    return {
        "schema": SCHEMA,
        "config": {**asdict(config), "slots": list(config.slots), "block_size": B},
        "dtype": str(target.dtype).removeprefix("mlx.core."),
        # How fast this host runs Python, before the runs and after them (host-bound rounds
        # follow it; see hf2q.platform.host_loop_ms).
        "host": {
            "python_loop_adds": HOST_LOOP_ADDS,
            "python_loop_ms_before": host_before,
            "python_loop_ms_after": host_loop_ms(),
        },
        "results": rows,
    }


def _rows_for(N: int, runs: dict[str, list[RunResult]], B: int) -> list[dict[str, Any]]:
    out = []
    plain = runs.get("plain")
    for mode, results in runs.items():
        tps, tps_lo, tps_hi = _stats([r.tokens_per_s for r in results])
        rnd, rnd_lo, rnd_hi = _stats([r.round_s for r in results])
        last = results[-1]
        n_slots = len(last.per_slot_tokens_per_s)
        row: dict[str, Any] = {
            "slots": N,
            "mode": mode,
            "tokens_per_s": _rnd(tps, 2),
            "tokens_per_s_min": _rnd(tps_lo, 2),
            "tokens_per_s_max": _rnd(tps_hi, 2),
            "per_slot_tokens_per_s": [
                _rnd(statistics.median(r.per_slot_tokens_per_s[i] for r in results), 2)
                for i in range(n_slots)
            ],
            "prefill_tokens_per_s": _rnd(
                statistics.median(r.prefill_tokens_per_s for r in results), 1
            ),
            "tau": _rnd(last.tau),
            "tau_per_slot": [_rnd(t) for t in last.tau_per_slot] if last.tau_per_slot else None,
            "accepted_histogram_per_slot": last.accepted_histogram_per_slot,
            "acceptance_rate": _rnd(last.acceptance_rate),
            "round_ms": _ms(rnd),
            "round_ms_min": _ms(rnd_lo),
            "round_ms_max": _ms(rnd_hi),
            "draft_ms": _ms(_median_opt([r.draft_s for r in results])),
            "verify_ms": _ms(_median_opt([r.verify_s for r in results])),
            "rollback_ms": _ms(_median_opt([r.rollback_s for r in results])),
            "E": None,
            "speedup_vs_plain": None,
            "scaling_vs_1_slot": None,
            "peak_memory_gb": _rnd(max(r.peak_memory_gb for r in results), 4),
            "rounds": last.rounds,
            "busy_rows": _rnd(last.busy_rows, 2),
            "lookup_share": _rnd(last.lookup_share),
            "generation_tokens": last.generation_tokens,
            "block_size": None if mode == "plain" else B,
            "matches_plain": None,
            "trials": len(results),
        }
        if mode == "dflash" and plain:
            # E at the same N: one plain batched step against one batched DFlash round.
            row["E"] = _rnd(statistics.median(r.round_s for r in plain) / rnd, 4)
        if mode != "plain" and plain:
            same = [a == b for a, b in zip(last.tokens, plain[-1].tokens)]
            row["matches_plain"] = _rnd(sum(same) / len(same), 4)
        out.append(row)
    return out


def _median_opt(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _relate(rows: list[dict[str, Any]]) -> None:
    """Fill the fields that relate rows: speedups against plain, scaling against one slot, and E
    of ``dflash-seq`` (single-sequence rounds against a one-row plain step)."""
    by = {(r["slots"], r["mode"]): r for r in rows}
    plain1 = by.get((1, "plain"))
    for r in rows:
        plain = by.get((r["slots"], "plain"))
        if r["mode"] != "plain" and plain and plain["tokens_per_s"]:
            r["speedup_vs_plain"] = _rnd(r["tokens_per_s"] / plain["tokens_per_s"], 3)
        one = by.get((1, r["mode"]))
        if one and one["tokens_per_s"]:
            r["scaling_vs_1_slot"] = _rnd(r["tokens_per_s"] / one["tokens_per_s"], 3)
        if r["mode"] == "dflash-seq" and plain1 and r["round_ms"]:
            r["E"] = _rnd(plain1["round_ms"] / r["round_ms"], 4)
