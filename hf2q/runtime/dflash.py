"""Decoding loops: DFlash speculative decoding and plain one-token-per-step decoding.

What it does: :func:`dflash_generate` and :func:`plain_generate` are generators that yield typed
events (:class:`PrefillDone`, then :class:`RoundDone` per DFlash round or :class:`StepDone` per
plain step, then one :class:`Summary`). Both share the prefill, the sampling functions and the
stop rules, so their tokens and timings compare like with like.

One DFlash round (block size B, ``shared/docs/dflash.md``)::

    block = [last committed token, MASK x (B-1)]          -> drafter -> d_1..d_{B-1}
    verify  [last, d_1..d_{B-1}] with the target (features of target_layer_ids captured)
    accept  a drafts (greedy match, or rejection sampling at T > 0), bonus = target's token
    commit  d_1..d_a, bonus; roll the target back to the last committed position (no re-run)
    the features of the first a+1 verify positions become new drafter context

What it does not do: load models, tokenize, print, or render (see ``hf2q.runtime.pair`` and the
CLI). Conventions (same as ``mlx_lm.generate.stream_generate``): the prompt is processed with all
but its last token in chunks, then the last token alone gives the first generated token; an EOS
token that stops generation is included in ``tokens`` (finish reason ``"stop"``), and
``max_tokens`` counts every generated token including it (finish reason ``"length"``).

Timing: ``prefill_time`` covers the prompt and the first token; ``generation_tps`` counts the
tokens after the first over the time after the first, so prefill is excluded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from hf2q.errors import UsageError
from hf2q.kernels.forward import CompiledDecode
from hf2q.kernels.layers import decode_layer_fn, prefill_layer_fn
from hf2q.kernels.select import (
    compile_forward_enabled,
    compile_forward_forced,
    fuse_proj_enabled,
    lagged_for,
    row_attention_enabled,
    small_mm_enabled,
)
from hf2q.runtime.block_size import AUTO, BlockChooser
from hf2q.runtime.cache import TargetCache, make_target_cache, unbucketed
from hf2q.runtime.drafter import DFlashDraftModel
from hf2q.runtime.lookup import LookupChooser
from hf2q.runtime.sampling import (
    KeyStream,
    SamplingParams,
    accept_greedy,
    accept_rejection,
    choose,
    point_masses,
    probs,
)
from hf2q.runtime.target import TargetModel
from hf2q.runtime.verify import verify_forward, whole_verify

#: No compiled graphs for a block size (the layer path and the drafter's layers run).
NO_GRAPHS: tuple[None, None] = (None, None)

#: Prompt positions processed per target forward during prefill (mlx-lm's default).
PREFILL_STEP_SIZE = 2048


# ---- events -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillDone:
    """The prompt is processed and the first token chosen from its last position."""

    prompt_tokens: int
    prefill_time: float  # seconds, prompt forward(s) + first token
    prompt_tps: float
    token: int  # the first generated token
    finish_reason: str | None  # "stop"/"length" if generation ends with this token


@dataclass(frozen=True)
class RoundDone:
    """One DFlash round: draft, verify, accept, roll back."""

    index: int  # 1-based
    block_size: int  # B of this round (smaller than configured near max_tokens; auto: chosen)
    drafted: int  # B - 1
    accepted: int  # a, drafts accepted
    bonus: int  # the target's token after the accepted drafts
    rolled_back: int  # B - 1 - a
    committed: tuple[int, ...]  # d_1..d_a, bonus; truncated at EOS / max_tokens
    t_draft: float  # seconds: host time queuing the draft + the wait for it
    t_verify: float  # seconds, includes acceptance
    t_rollback: float  # seconds
    generated: int  # tokens generated so far, the first one included
    elapsed: float  # seconds since the first token
    finish_reason: str | None
    source: str = "drafter"  # who drafted: "drafter" or "lookup" (``lookup=True``)


@dataclass(frozen=True)
class StepDone:
    """One plain decoding step."""

    index: int  # 1-based, counting tokens after the first
    token: int
    t_step: float  # seconds since the previous token
    generated: int
    elapsed: float
    finish_reason: str | None


@dataclass(frozen=True)
class Summary:
    """The whole generation. DFlash-only fields are None for plain decoding."""

    mode: str  # "dflash" or "plain"
    tokens: list[int]  # generated ids (a stopping EOS included)
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    prompt_tokens: int
    generation_tokens: int
    prefill_time: float
    decode_time: float  # seconds after the first token
    prompt_tps: float
    generation_tps: float  # (generation_tokens - 1) / decode_time; prefill excluded
    peak_memory_gb: float
    seed: int | None  # key seed when T > 0
    rounds: int | None = None
    block_size: int | None = None
    tau: float | None = None  # mean(a + 1)
    acceptance_rate: float | None = None  # sum(a) / sum(B - 1)
    draft_share: float | None = None  # sum(a) / sum(a + 1)
    accepted_histogram: list[int] | None = None  # [rounds with a == 0, a == 1, ..., a == B-1]
    drafted: int | None = None  # sum over rounds of B - 1
    accepted: int | None = None  # sum over rounds of a
    t_draft: float | None = None  # totals over rounds, seconds
    t_verify: float | None = None
    t_rollback: float | None = None
    lookup_rounds: int | None = None  # rounds drafted by lookup (``lookup=True``), else None
    block_sizes: dict[int, int] | None = None  # rounds at each size (auto sizes), else None


Event = PrefillDone | RoundDone | StepDone | Summary


# ---- shared pieces ------------------------------------------------------------------------------
def _check_common(prompt: Sequence[int], max_tokens: int, sampling: SamplingParams) -> None:
    if len(prompt) == 0:
        raise UsageError("the prompt is empty: pass some text (argument, --prompt-file or stdin)")
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
    sampling.validate()


def prefill(
    target: TargetModel,
    prompt: Sequence[int],
    cache: list[Any],
    *,
    drafter: DFlashDraftModel | None = None,
    draft_cache: list[Any] | None = None,
    step_size: int = PREFILL_STEP_SIZE,
) -> tuple[mx.array, mx.array | None]:
    """Process ``prompt`` into ``cache`` the way mlx-lm's ``generate_step`` does.

    All but the last token go in chunks of ``step_size`` (caches evaluated after each; attention
    over exactly the keys held, as plain decoding's cache: :func:`~hf2q.runtime.cache.unbucketed`),
    then the last token alone; on CUDA through the compiled runners (:func:`prefill_layer_fn`; not with
    ``HF2Q_PREFILL_RUNNERS=0``), elsewhere through the model's own layer calls. With a
    drafter, each chunk's features of ``target_layer_ids`` are appended to ``draft_cache``; the
    last token's features are returned for the first draft instead.

    Returns:
        ``(logits, features)``: logits (1, vocab) of the last position (lazy); features
        (1, 1, n_ids*H) of the last position, or None without a drafter.
    """
    ids = drafter.config.target_layer_ids if drafter is not None else ()
    toks = mx.array(list(prompt), dtype=mx.int32)
    n = toks.shape[0]
    start = 0
    # On CUDA (unless HF2Q_PREFILL_RUNNERS=0): chunks through the compiled runners, the last token
    # as a decode step; elsewhere both through the model's own layer calls.
    chunk_fn = prefill_layer_fn()
    last_fn = decode_layer_fn() if chunk_fn is not None else None
    while n - start > 1:
        end = min(start + step_size, n - 1)
        with unbucketed(cache):  # the keys plain decoding's cache attends over (bit-equal)
            _, feats = target.forward(
                toks[None, start:end], cache, capture=ids, last_only=True, layer_fn=chunk_fn
            )
        state = [c.state for c in cache]
        if drafter is not None:
            drafter.add_context(feats, draft_cache)
            state.append([c.state for c in draft_cache])
        mx.eval(state)
        start = end
        mx.clear_cache()
    logits, feats = target.forward(toks[None, n - 1 :], cache, capture=ids, layer_fn=last_fn)
    return logits[:, -1], feats


def block_and_steps(
    target: TargetModel, prompt: Sequence[int], tokens: mx.array, *, capture: Sequence[int] = ()
) -> tuple[tuple[mx.array, mx.array | None], tuple[mx.array, mx.array | None]]:
    """The target over ``tokens`` (1, T) after ``prompt``, the two ways decoding computes them.

    Once as one DFlash verify block (the DFlash cache, :func:`verify_forward`, as one compiled
    graph where DFlash's rounds run it: :func:`~hf2q.runtime.verify.whole_verify`) and once as T
    plain decoding steps (plain decoding's cache and layer function), each after its own
    :func:`prefill`. Returns ``((logits, features) of the block, (logits, features) of the steps
    joined over the T positions)``, as :meth:`TargetModel.forward` returns them. Greedy DFlash
    is lossless when the two agree; bit-equal rows make it exact in any dtype.
    """
    cache = make_target_cache(target.model)
    prefill(target, prompt, cache)
    whole = whole_verify(target, cache, tokens.shape[1], capture)
    block = verify_forward(target, tokens, cache, capture=capture, whole=whole)
    cache = target.make_cache()
    prefill(target, prompt, cache)
    fn = decode_layer_fn()
    outs = [
        target.forward(tokens[:, i : i + 1], cache, capture=capture, layer_fn=fn)
        for i in range(tokens.shape[1])
    ]
    feats = None if not capture else mx.concatenate([o[1] for o in outs], axis=1)
    return block, (mx.concatenate([o[0] for o in outs], axis=1), feats)


def _finish(token: int, generated: int, max_tokens: int, eos: frozenset[int]) -> str | None:
    if token in eos:
        return "stop"
    if generated >= max_tokens:
        return "length"
    return None


def _peak_gb() -> float:
    return mx.get_peak_memory() / 1e9


# ---- DFlash -------------------------------------------------------------------------------------
def dflash_generate(
    target: TargetModel,
    drafter: DFlashDraftModel,
    prompt: Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    block_size: int | str | None = None,
    eos_token_ids: Iterable[int] = (),
    prefill_step_size: int = PREFILL_STEP_SIZE,
    lookup: bool = False,
    lagged: bool | None = None,
) -> Iterator[Event]:
    """Generate with DFlash speculative decoding; yield events (see the module docstring).

    Args:
        target: the target model; ``drafter`` must be bound to its embedding and head.
        drafter: the DFlash drafter (validated against the target, see ``hf2q.runtime.pair``).
        prompt: prompt token ids (chat template already applied).
        max_tokens: most tokens to generate (>= 1).
        sampling: temperature / top-p / top-k / seed; default greedy.
        block_size: B, 2..drafter.block_size; default the drafter's. ``"auto"``: each round's
            size, 2 up to the drafter's, from what earlier rounds cost and accepted
            (:mod:`hf2q.runtime.block_size`), where rounds are greedy and synchronous
            (:func:`auto_block_applies`; elsewhere the drafter's size).
        eos_token_ids: tokens that stop generation (included in the output).
        lookup: a round may draft the continuation of the sequence's own last n-gram instead
            of running the drafter, when that has been accepting more
            (:mod:`hf2q.runtime.lookup`); greedy output is the same, sampled output keeps the
            target's distribution (the proposal's q puts all mass on each proposed token);
            only the rounds differ.
        lagged: queue each round before reading the last one's acceptance
            (:func:`_dflash_lagged`; with ``lookup``, synchronous rounds while a lookup
            proposal is due); None: ``hf2q.kernels.select.lagged_for(lookup)``
            (``HF2Q_LAGGED_ROUNDS``, on CUDA only; with lookup also ``HF2Q_LAGGED_LOOKUP``). Same greedy
            tokens; sampled, the same distribution (the same draws while every round's block is
            whole, e.g. ``block_size=2``).

    Raises:
        UsageError: empty prompt, ``max_tokens < 1``, block size out of range, bad sampling.
    """
    sampling = sampling or SamplingParams()
    _check_common(prompt, max_tokens, sampling)
    auto = block_size == AUTO
    B = drafter.block_size if block_size is None or auto else int(block_size)
    if not 2 <= B <= drafter.block_size:
        raise UsageError(
            f"--block-size must be between 2 and the drafter's block size {drafter.block_size}, got {B}"
        )
    if not drafter.is_bound:
        drafter.bind(target.embed, target.head)
    run = (target, drafter, list(prompt), max_tokens, sampling, B)
    eos, step = frozenset(eos_token_ids), prefill_step_size
    lag = lagged_for(lookup) if lagged is None else lagged
    if lag:
        return _dflash_lagged(*run, eos, step, lookup)
    return _dflash(*run, eos, step, lookup, auto and auto_block_applies(sampling, lag))


def auto_block_applies(sampling: SamplingParams, lagged: bool) -> bool:
    """Whether ``block_size="auto"`` chooses each round's size: greedy (a seeded sampled run's
    draws would depend on the machine's timings) and synchronous rounds (a lagged round is
    queued before the last one's outcome is known); elsewhere rounds keep the drafter's size."""
    return sampling.greedy and not lagged


def _dflash_lagged(
    target: TargetModel,
    drafter: DFlashDraftModel,
    prompt: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    B: int,
    eos: frozenset[int],
    step_size: int,
    lookup: bool = False,
) -> Iterator[Event]:
    """DFlash with lagged rounds: the batched runtime's (``hf2q.runtime.slots``) with
    one slot, whose events are told here as a single run's. Each round is queued before the
    previous one's acceptance is read (the bonus token, the drafter's context and the target's
    rollback stay on the device); the round's time split is the host's building (``t_draft``)
    and its wait (``t_verify``). With ``lookup``, rounds whose lookup proposal is due run
    synchronously."""
    from hf2q.runtime.slots import (
        Request,
        SlotFinished,
        SlotRound,
        SlotStarted,
        slots_dflash_generate,
    )

    events = slots_dflash_generate(
        target,
        drafter,
        [Request(prompt, max_tokens, seed=sampling.seed)],
        slots=1,
        sampling=sampling,
        block_size=B,
        eos_token_ids=eos,
        prefill_step_size=step_size,
        lookup=lookup,
        lagged=True,
    )
    generated = rounds = 0
    for e in events:
        if isinstance(e, SlotStarted):
            generated = 1
            tps = e.prompt_tokens / e.prefill_time if e.prefill_time > 0 else 0.0
            yield PrefillDone(e.prompt_tokens, e.prefill_time, tps, e.token, e.finish_reason)
        elif isinstance(e, SlotRound) and e.slots:
            a, kept = e.accepted[0], e.committed[0]
            generated += len(kept)
            rounds += 1
            finish = _finish(kept[-1], generated, max_tokens, eos) if e.finished else None
            yield RoundDone(
                index=rounds,
                block_size=e.block_size,
                drafted=e.block_size - 1,
                accepted=a,
                bonus=e.bonus[0],
                rolled_back=e.block_size - 1 - a,
                committed=kept,
                t_draft=e.t_draft,
                t_verify=e.t_verify,
                t_rollback=e.t_rollback,
                generated=generated,
                elapsed=e.elapsed,
                finish_reason=finish,
                source=e.sources[0],
            )
        elif isinstance(e, SlotFinished):
            yield e.summary


def _dflash(
    target: TargetModel,
    drafter: DFlashDraftModel,
    prompt: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    B: int,
    eos: frozenset[int],
    step_size: int,
    lookup: bool = False,
    auto: bool = False,
) -> Iterator[Event]:
    keys = None if sampling.greedy else KeyStream(sampling.seed)
    mask_id = drafter.mask_token_id
    ids = drafter.config.target_layer_ids
    mx.reset_peak_memory()
    tcache: TargetCache = make_target_cache(target)
    dcache = drafter.make_cache()

    tic = time.perf_counter()
    logits, ctx = prefill(
        target, prompt, tcache, drafter=drafter, draft_cache=dcache, step_size=step_size
    )
    first = choose(logits, sampling, keys)
    mx.eval(first, ctx)
    token = int(first.item())
    t_first = time.perf_counter()
    prefill_time = t_first - tic
    tokens = [token]
    finish = _finish(token, 1, max_tokens, eos)
    yield PrefillDone(len(prompt), prefill_time, len(prompt) / prefill_time, token, finish)

    chooser = LookupChooser([*prompt, token]) if lookup else None
    sizes = BlockChooser(B) if auto else None  # each round's size (``--block-size auto``)
    # Block size -> full blocks of it as one compiled verify graph (CUDA) and one draft graph
    # (HF2Q_COMPILE_DRAFT=1), made once a size: the configured size, or each auto size.
    graphs: dict[int, tuple[Any, Any]] = {}
    unseen: list[mx.array] = []  # verified context rows the drafter has not been given yet

    def submit_draft(last: int, ctx: mx.array) -> tuple[mx.array, mx.array | None, int, str]:
        """Queue the draft of block [last, MASK x (bs-1)]: the drafter forward, or the lookup
        proposal when the chooser picks it; return (draft, q, bs, source)."""
        size = sizes.next() if sizes is not None else B
        if size not in graphs:  # a last, shorter block keeps the layer path (no graph for it)
            graphs[size] = (whole_verify(target, tcache, size, ids), drafter.graph(size))
        bs = min(size, max_tokens - len(tokens) + 1)  # never draft more than can be committed
        unseen.append(ctx)
        proposal = chooser.proposal(bs - 1) if chooser is not None else None
        if proposal is not None:  # the drafter catches up on these rows in its next forward
            return mx.array(proposal, dtype=mx.int32), None, bs, "lookup"
        rows = unseen[0] if len(unseen) == 1 else mx.concatenate(unseen, axis=1)
        unseen.clear()
        block = mx.array([[last] + [mask_id] * (bs - 1)], dtype=mx.int32)
        dlogits = drafter(block, rows, dcache, graphs.get(bs, NO_GRAPHS)[1])[0]  # (bs-1, V)
        if sampling.greedy:
            draft, q = drafter.proposals(dlogits), None
        else:
            q = probs(drafter.full_logits(dlogits), sampling)
            draft = mx.random.categorical(mx.log(q), axis=-1, key=keys.next()).astype(mx.int32)
        mx.async_eval(draft)
        return draft, q, bs, "drafter"

    hist = [0] * B
    n_rounds = sum_a = sum_drafted = 0
    t_draft_sum = t_verify_sum = t_roll_sum = 0.0
    tq = time.perf_counter()
    pending = submit_draft(tokens[-1], ctx) if finish is None else None
    t_queue = time.perf_counter() - tq  # host time spent building and queuing the draft
    while finish is None:
        # The round's draft was queued before the previous event was handed out, so it ran on
        # the device meanwhile; t_draft is the host time spent queuing it plus the part of it
        # the loop still had to wait for. The verify graph is built while the draft may still
        # be running (it cannot start earlier).
        t0 = time.perf_counter()
        draft, q, bs, source = pending
        last = tokens[-1]
        vin = mx.concatenate([mx.array([last], dtype=mx.int32), draft])[None]  # (1, bs)
        whole = graphs.get(bs, NO_GRAPHS)[0]
        vlogits, feats = verify_forward(target, vin, tcache, capture=ids, whole=whole)
        if sampling.greedy:
            a_arr, bonus_arr = accept_greedy(draft, mx.argmax(vlogits[0], axis=-1).astype(mx.int32))
        else:
            if source == "lookup":  # a deterministic proposal: all of q's mass on each token
                q = point_masses(draft, vlogits.shape[-1])
            a_arr, bonus_arr = accept_rejection(draft, q, probs(vlogits[0], sampling), keys.next())
        mx.eval(draft)
        t1 = time.perf_counter()
        mx.eval(a_arr, bonus_arr)
        a, bonus = int(a_arr.item()), int(bonus_arr.item())
        t2 = time.perf_counter()

        tcache.rollback(a + 1)
        ctx = feats[:, : a + 1]  # the verified positions become drafter context
        t3 = time.perf_counter()

        committed = draft[:a].tolist() + [bonus]
        kept: list[int] = []
        for tok in committed:
            kept.append(tok)
            finish = _finish(tok, len(tokens) + len(kept), max_tokens, eos)
            if finish is not None:
                break
        tokens.extend(kept)
        if chooser is not None:
            chooser.round_done(source, a, kept)
        if sizes is not None:
            t_round = t_queue + time.perf_counter() - t0
            sizes.record(bs, a, t_round)
        t_draft = t1 - t0 + t_queue
        t_roll = t3 - t2
        if finish is None:
            # Queue the next draft (and the restored states) before handing the event out.
            tq = time.perf_counter()
            pending = submit_draft(bonus, ctx)
            t_queue = time.perf_counter() - tq
            mx.async_eval(tcache.state)
            t_roll += time.perf_counter() - tq - t_queue

        n_rounds += 1
        sum_a += a
        sum_drafted += bs - 1
        hist[a] += 1
        t_draft_sum += t_draft
        t_verify_sum += t2 - t1
        t_roll_sum += t_roll
        yield RoundDone(
            index=n_rounds,
            block_size=bs,
            drafted=bs - 1,
            accepted=a,
            bonus=bonus,
            rolled_back=bs - 1 - a,
            committed=tuple(kept),
            t_draft=t_draft,
            t_verify=t2 - t1,
            t_rollback=t_roll,
            generated=len(tokens),
            elapsed=time.perf_counter() - t_first,
            finish_reason=finish,
            source=source,
        )

    decode_time = time.perf_counter() - t_first
    tau, rate, share = pooled_acceptance(sum_a, n_rounds, sum_drafted)
    yield _summary(
        "dflash",
        tokens,
        finish,
        len(prompt),
        prefill_time,
        decode_time,
        keys,
        rounds=n_rounds,
        block_size=B,
        tau=tau,
        acceptance_rate=rate,
        draft_share=share,
        accepted_histogram=hist,
        drafted=sum_drafted,
        accepted=sum_a,
        t_draft=t_draft_sum,
        t_verify=t_verify_sum,
        t_rollback=t_roll_sum,
        lookup_rounds=chooser.lookup_rounds if chooser is not None else None,
        block_sizes=dict(sorted(sizes.rounds.items())) if sizes is not None else None,
    )


def _summary(
    mode: str,
    tokens: list[int],
    finish: str | None,
    prompt_tokens: int,
    prefill_time: float,
    decode_time: float,
    keys: KeyStream | None,
    **dflash_fields: Any,
) -> Summary:
    """The run's :class:`Summary`: the fields both modes share, plus DFlash's own."""
    return Summary(
        mode=mode,
        tokens=tokens,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        generation_tokens=len(tokens),
        prefill_time=prefill_time,
        decode_time=decode_time,
        prompt_tps=prompt_tokens / prefill_time,
        generation_tps=tokens_per_s(len(tokens) - 1, decode_time),
        peak_memory_gb=_peak_gb(),
        seed=keys.seed if keys else None,
        **dflash_fields,
    )


def final_event(events: Iterable[Any], kind: type, what: str) -> Any:
    """Consume ``events`` and return the last one of type ``kind`` (a run's summary)."""
    last = None
    for ev in events:
        if isinstance(ev, kind):
            last = ev
    if last is None:
        raise RuntimeError(f"the {what} ended without a summary")
    return last


def pooled_acceptance(
    sum_a: int, rounds: int, drafted: int
) -> tuple[float | None, float | None, float | None]:
    """``(tau, acceptance_rate, draft_share)`` of pooled rounds (dflash.md metrics).

    tau = mean over rounds of (a + 1) = (sum a + rounds) / rounds; acceptance rate = sum a /
    sum (B - 1) drafted; draft share = sum a / sum (a + 1). None where there is no round / draft.
    """
    tau = (sum_a + rounds) / rounds if rounds else None
    rate = sum_a / drafted if drafted else None
    share = sum_a / (sum_a + rounds) if rounds else None
    return tau, rate, share


def tokens_per_s(n: int, seconds: float) -> float:
    """``n / seconds``, 0 when either is not positive (a run with nothing to time)."""
    return n / seconds if seconds > 0 and n > 0 else 0.0


# ---- plain --------------------------------------------------------------------------------------
def plain_generate(
    target: TargetModel,
    prompt: Sequence[int],
    *,
    max_tokens: int = 256,
    sampling: SamplingParams | None = None,
    eos_token_ids: Iterable[int] = (),
    prefill_step_size: int = PREFILL_STEP_SIZE,
) -> Iterator[Event]:
    """Generate one token per target step with mlx-lm's caches (and, on CUDA, hf2q's kernels).

    Same prefill, sampling and stop rules as :func:`dflash_generate`; the next step is queued
    with ``mx.async_eval`` before the current token is read, as mlx-lm's ``generate_step`` does.
    """
    sampling = sampling or SamplingParams()
    _check_common(prompt, max_tokens, sampling)
    return _plain(
        target, list(prompt), max_tokens, sampling, frozenset(eos_token_ids), prefill_step_size
    )


def _plain(
    target: TargetModel,
    prompt: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    eos: frozenset[int],
    step_size: int,
) -> Iterator[Event]:
    keys = None if sampling.greedy else KeyStream(sampling.seed)
    model = target.model
    mx.reset_peak_memory()
    cache = target.make_cache()

    tic = time.perf_counter()
    logits, _ = prefill(target, prompt, cache, step_size=step_size)
    y = choose(logits, sampling, keys)  # (1,)

    layer_fn = decode_layer_fn()
    mm = small_mm_enabled()  # the head's product, read once as the layers' is
    whole = None  # where the runners run (CUDA): each step one compiled graph, same bits
    rows = row_attention_enabled()
    if (
        layer_fn is not None
        and compile_forward_enabled()
        and CompiledDecode.supports(target, cache)
        and (compile_forward_forced() or CompiledDecode.exact(target, rows))
    ):
        whole = CompiledDecode(target, fuse_proj=fuse_proj_enabled(), mm=mm, rows=rows)

    def step(y: mx.array) -> mx.array:
        if layer_fn is None:
            return choose(model(y[None], cache=cache)[:, -1], sampling, keys)
        if whole is not None:
            return choose(whole(y[None], cache)[:, -1], sampling, keys)
        logits, _ = target.forward(y[None], cache, layer_fn=layer_fn, mm=mm)
        return choose(logits[:, -1], sampling, keys)

    mx.async_eval(y)
    token = int(y.item())
    t_first = t_prev = time.perf_counter()
    prefill_time = t_first - tic
    tokens = [token]
    finish = _finish(token, 1, max_tokens, eos)
    yield PrefillDone(len(prompt), prefill_time, len(prompt) / prefill_time, token, finish)
    if finish is None:
        nxt = step(y)
        mx.async_eval(nxt)
    while finish is None:
        y = nxt
        if len(tokens) + 1 < max_tokens:
            nxt = step(y)  # queue the following step before reading this one
            mx.async_eval(nxt)
        token = int(y.item())
        tokens.append(token)
        finish = _finish(token, len(tokens), max_tokens, eos)
        now = time.perf_counter()
        yield StepDone(len(tokens) - 1, token, now - t_prev, len(tokens), now - t_first, finish)
        t_prev = now
        if len(tokens) % 256 == 0:
            mx.clear_cache()

    decode_time = time.perf_counter() - t_first
    yield _summary("plain", tokens, finish, len(prompt), prefill_time, decode_time, keys)


@dataclass(frozen=True)
class AcceptanceStats:
    """DFlash acceptance pooled over the rounds of several generations (dflash.md metrics)."""

    rounds: int
    tokens: int
    tau: float  # mean over all rounds of (a + 1)
    acceptance_rate: float  # sum(a) / sum(B - 1)
    accepted_histogram: list[int]  # rounds with a == 0, 1, ..., B-1
    drafted: int = 0  # sum(B - 1) over all rounds
    per_prompt_tau: list[float] = field(default_factory=list)  # prompts that had a round
    outputs: list[list[int]] = field(default_factory=list)  # generated ids, one list per prompt


def measure_acceptance(
    target: TargetModel,
    drafter: DFlashDraftModel,
    prompts: Iterable[Sequence[int]],
    *,
    max_tokens: int = 256,
    block_size: int | None = None,
    sampling: SamplingParams | None = None,
    eos_token_ids: Iterable[int] = (),
) -> AcceptanceStats:
    """Run the real decoding loop on each prompt and pool tau / acceptance over all rounds.

    This is how a drafter should be judged (training accuracy is not a gate, see dflash.md).
    """
    eos = list(eos_token_ids)
    sum_a = sum_drafted = rounds = tokens = 0
    hist: list[int] = []
    per_prompt: list[float] = []
    outputs: list[list[int]] = []
    for prompt in prompts:
        s = run(
            dflash_generate(
                target,
                drafter,
                list(prompt),
                max_tokens=max_tokens,
                block_size=block_size,
                sampling=sampling,
                eos_token_ids=eos,
            )
        )
        h = s.accepted_histogram or []
        hist = [x + y for x, y in zip(hist or [0] * len(h), h)]
        rounds += s.rounds or 0
        tokens += s.generation_tokens
        sum_a += s.accepted or 0
        sum_drafted += s.drafted or 0
        outputs.append(list(s.tokens))
        if s.tau is not None:  # a generation that stops on its first token has no round
            per_prompt.append(s.tau)
    tau, rate, _ = pooled_acceptance(sum_a, rounds, sum_drafted)
    return AcceptanceStats(
        rounds=rounds,
        tokens=tokens,
        tau=tau if tau is not None else 0.0,
        acceptance_rate=rate if rate is not None else 0.0,
        accepted_histogram=hist,
        drafted=sum_drafted,
        per_prompt_tau=per_prompt,
        outputs=outputs,
    )


def run(events: Iterable[Event]) -> Summary:
    """Consume a generator of events and return its :class:`Summary`."""
    return final_event(events, Summary, "generation")


__all__ = [
    "PREFILL_STEP_SIZE",
    "Event",
    "PrefillDone",
    "RoundDone",
    "StepDone",
    "Summary",
    "dflash_generate",
    "plain_generate",
    "prefill",
    "run",
    "AcceptanceStats",
    "measure_acceptance",
    "pooled_acceptance",
    "tokens_per_s",
]
