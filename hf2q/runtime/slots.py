"""Batched decoding: N sequences ("slots") decoded in lockstep, with DFlash or plain steps.

What it does: :func:`slots_dflash_generate` runs DFlash on up to N requests at once. One round is
one batched drafter forward over N blocks and one batched target verify over N x B tokens; each
row accepts its own count ``a_i``, so the rollback is ragged: attention KV per row
(:class:`~hf2q.runtime.slot_cache.SlotKVCache` moves that row's offset back) and Gated-DeltaNet
state per row (:class:`~hf2q.runtime.cache.GDNRollbackCache` restores row i after ``a_i + 1``
positions). :func:`slots_plain_generate` is the baseline: N rows, one token each per step, on the
same caches, computed as single-sequence plain decoding is (mlx-lm's own model call; on CUDA
hf2q's compiled layers with the fused Gated-DeltaNet kernel, ``decode_layer_fn``). Both are
generators of typed events (:class:`SlotStarted`, :class:`SlotRound`, :class:`SlotFinished`, one
final :class:`SlotsSummary`).

Scheduling (continuous batching): requests wait in a queue; a free slot takes the next one, which
is prefilled alone (``hf2q.runtime.dflash.prefill``, exactly as a single-sequence run) and copied
into that slot's rows. Slots stop independently (EOS, their own ``max_tokens``). A slot left
without work either is compacted away (``idle="compact"``, the default: the caches keep only the
busy rows, a one-off gather) or keeps computing masked garbage (``idle="keep"``); neither changes
the other rows' tokens.

Isolation: at T = 0 every request's tokens equal its single-sequence DFlash run and its plain
greedy decoding (tests). At T > 0 each request samples with its own key stream (``Request.seed``)
through the same rejection sampling as the single-sequence path.

Round block size: the verify is rectangular, so a round uses ``B_r = min(B, max_i(remaining_i) + 1)``
positions for every row (the single-sequence rule applied to the row with most left, so one slot
is exactly a single run); row i accepts at most its first ``min(B, remaining_i + 1) - 1`` drafts,
as a single run would. (The non-causal drafter sees the longer block, so in a request's last rounds
its drafts and acceptance statistics may differ from a single run of it; its tokens do not.)

What it does not do: tokenize, load models, print, or batch prefills (each request is prefilled
alone). Conventions (EOS included and counted, ``max_tokens``, prefill excluded from tok/s) are
those of ``hf2q.runtime.dflash``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from hf2q.errors import UsageError
from hf2q.kernels import cuda_readback
from hf2q.kernels.cuda_accept import accept_greedy_cuda
from hf2q.kernels.cuda_readback import host_ints
from hf2q.kernels.forward import CompiledVerify
from hf2q.kernels.layers import decode_layer_fn
from hf2q.kernels.select import (
    accept_kernel_enabled,
    draft_ahead_enabled,
    lag_depth,
    lagged_draft_first,
    lagged_for,
    lagged_lookup_mode,
    round_words_enabled,
    small_mm_enabled,
)
from hf2q.runtime.cache import make_target_cache
from hf2q.runtime.dflash import (
    PREFILL_STEP_SIZE,
    Summary,
    final_event,
    pooled_acceptance,
    prefill,
    tokens_per_s,
)
from hf2q.runtime.drafter import DFlashDraftModel
from hf2q.runtime.lookup import LookupChooser, RowsLookup
from hf2q.runtime.sampling import (
    KeyStream,
    SamplingParams,
    accept_greedy,
    accept_rejection,
    choose,
    point_masses,
    probs,
)
from hf2q.runtime.slot_cache import (
    SlotKVCache,
    SlotTargetCache,
    insert_draft_rows,
    make_slot_draft_cache,
    make_slot_target_cache,
)
from hf2q.runtime.target import TargetModel
from hf2q.runtime.verify import verify_forward, whole_verify

IDLE_POLICIES = ("compact", "keep")


# ---- requests and events ------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """One prompt to decode in a slot.

    Attributes:
        prompt: token ids (chat template already applied).
        max_tokens: most tokens to generate (the stopping EOS counted).
        seed: key seed at T > 0 (a single-sequence run with this seed draws the same keys);
            None: ``sampling.seed + index`` when a sampling seed is set, else random.
    """

    prompt: Sequence[int]
    max_tokens: int = 256
    seed: int | None = None


@dataclass(frozen=True)
class SlotStarted:
    """A request was prefilled alone and placed in a slot; its first token is chosen."""

    slot: int
    request: int  # index in the request list
    prompt_tokens: int
    prefill_time: float  # seconds: prompt forward(s), first token, copy into the slot's rows
    token: int
    finish_reason: str | None  # set when the first token already ends the request


@dataclass(frozen=True)
class SlotRound:
    """One lockstep round over the busy slots (a DFlash round, or one plain step)."""

    index: int  # 1-based
    slots: tuple[int, ...]  # slots that decoded a request this round
    block_size: int  # verify positions per row (1 for plain decoding)
    accepted: tuple[int, ...]  # drafts accepted per slot (0 for plain decoding)
    committed: tuple[tuple[int, ...], ...]  # tokens committed per slot (cut at EOS / max_tokens)
    rows: int  # batch rows computed (busy slots + idle rows kept with idle="keep")
    t_draft: float  # seconds (0 for plain decoding)
    t_verify: float  # seconds, includes acceptance (plain: the step)
    t_rollback: float  # seconds
    elapsed: float  # decode seconds so far, rounds only
    finished: tuple[int, ...] = ()  # slots whose request ended this round
    bonus: tuple[int, ...] = ()  # per slot, the target's token after its accepted drafts (DFlash)
    sources: tuple[str, ...] = ()  # per slot, who drafted: "drafter" or "lookup" (DFlash)


@dataclass(frozen=True)
class SlotFinished:
    """A request ended (EOS or max_tokens); its slot is free again."""

    slot: int
    request: int
    summary: Summary


@dataclass(frozen=True)
class SlotStats:
    """What one slot did over the run (all the requests it served)."""

    slot: int
    requests: tuple[int, ...]
    generation_tokens: int
    decode_time: float  # seconds of rounds in which this slot was busy
    generation_tps: float  # tokens after each request's first / decode_time
    rounds: int
    tau: float | None = None
    acceptance_rate: float | None = None
    accepted_histogram: list[int] | None = None


@dataclass(frozen=True)
class SlotsSummary:
    """The whole batched run. DFlash-only fields are None for plain decoding."""

    mode: str  # "dflash" or "plain"
    slots: int
    requests: list[Summary]  # one per request, in request order
    per_slot: list[SlotStats]
    rounds: int
    prompt_tokens: int
    generation_tokens: int
    prefill_time: float  # seconds, all prefills (+ copies into slots)
    decode_time: float  # seconds in rounds only (prefill and slot filling excluded)
    prompt_tps: float
    generation_tps: float  # aggregate: sum over requests of tokens after the first / decode_time
    peak_memory_gb: float
    round_times: list[float] = field(default_factory=list)  # seconds per round
    row_rounds: int = 0  # sum over rounds of the requests decoding in it (busy rows)
    block_size: int | None = None
    tau: float | None = None
    acceptance_rate: float | None = None
    draft_share: float | None = None
    accepted_histogram: list[int] | None = None
    t_draft: float | None = None  # totals over rounds, seconds
    t_verify: float | None = None
    t_rollback: float | None = None


SlotEvent = SlotStarted | SlotRound | SlotFinished | SlotsSummary


# ---- per-request bookkeeping --------------------------------------------------------------------
@dataclass
class _Live:
    index: int
    slot: int
    prompt_tokens: int
    max_tokens: int
    keys: KeyStream | None
    prefill_time: float
    tokens: list[int]
    finish: str | None = None
    rounds: int = 0
    sum_a: int = 0
    drafted: int = 0
    hist: list[int] = field(default_factory=list)
    decode_time: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_rollback: float = 0.0
    chooser: LookupChooser | None = None  # lookup drafts (``lookup=True``)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def commit(self, toks: Sequence[int], eos: frozenset[int]) -> tuple[int, ...]:
        kept: list[int] = []
        for tok in toks:
            kept.append(int(tok))
            self.finish = _finish(int(tok), len(self.tokens) + len(kept), self.max_tokens, eos)
            if self.finish is not None:
                break
        self.tokens.extend(kept)
        return tuple(kept)

    def summary(self, mode: str, B: int | None) -> Summary:
        n = len(self.tokens)
        dflash = mode == "dflash"
        r = self.rounds
        tau, rate, share = pooled_acceptance(self.sum_a, r, self.drafted) if dflash else (None,) * 3
        return Summary(
            mode=mode,
            tokens=list(self.tokens),
            finish_reason=self.finish or "length",
            prompt_tokens=self.prompt_tokens,
            generation_tokens=n,
            prefill_time=self.prefill_time,
            decode_time=self.decode_time,
            prompt_tps=self.prompt_tokens / self.prefill_time if self.prefill_time > 0 else 0.0,
            generation_tps=tokens_per_s(n - 1, self.decode_time),
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            seed=self.keys.seed if self.keys else None,
            rounds=r if dflash else None,
            block_size=B if dflash else None,
            tau=tau,
            acceptance_rate=rate,
            draft_share=share,
            accepted_histogram=list(self.hist) if dflash else None,
            drafted=self.drafted if dflash else None,
            accepted=self.sum_a if dflash else None,
            t_draft=self.t_draft if dflash else None,
            t_verify=self.t_verify if dflash else None,
            t_rollback=self.t_rollback if dflash else None,
            lookup_rounds=self.chooser.lookup_rounds if self.chooser is not None else None,
        )


def _finish(token: int, generated: int, max_tokens: int, eos: frozenset[int]) -> str | None:
    if token in eos:
        return "stop"
    if generated >= max_tokens:
        return "length"
    return None


def _check(
    requests: Sequence[Request], slots: int, sampling: SamplingParams, idle: str
) -> list[Request]:
    reqs = [r if isinstance(r, Request) else Request(list(r)) for r in requests]
    if slots < 1:
        raise UsageError(f"--slots must be at least 1, got {slots}")
    if not reqs:
        raise UsageError("no requests to decode: pass at least one prompt")
    for i, r in enumerate(reqs):
        if len(r.prompt) == 0:
            raise UsageError(f"request {i} has an empty prompt: pass some text")
        if r.max_tokens < 1:
            raise UsageError(f"request {i}: max_tokens must be at least 1, got {r.max_tokens}")
    if idle not in IDLE_POLICIES:
        raise UsageError(f"idle must be one of {', '.join(IDLE_POLICIES)}, got {idle!r}")
    sampling.validate()
    return reqs


def _keys(req: Request, index: int, sampling: SamplingParams) -> KeyStream | None:
    if sampling.greedy:
        return None
    if req.seed is not None:
        return KeyStream(req.seed)
    return KeyStream(None if sampling.seed is None else sampling.seed + index)


class _Stats:
    """Aggregates over the run (rounds, totals) for :class:`SlotsSummary`."""

    def __init__(self, slots: int, B: int) -> None:
        self.rounds = 0
        self.round_times: list[float] = []
        self.t_draft = self.t_verify = self.t_roll = 0.0
        self.decode = 0.0
        self.prefill = 0.0
        self.sum_a = self.sum_drafted = self.n_row_rounds = 0
        self.hist = [0] * B
        self.done: dict[int, Summary] = {}
        self.by_slot: dict[int, list[_Live]] = {s: [] for s in range(slots)}

    def finish(self, live: _Live, mode: str, B: int | None) -> Summary:
        s = live.summary(mode, B)
        self.done[live.index] = s
        self.by_slot[live.slot].append(live)
        return s

    def started(
        self, live: _Live, tic: float, free_slots: list[int], mode: str, B: int | None
    ) -> Iterator[SlotEvent]:
        """A request's prefill is done: count its time, announce it, and finish it at once when
        its first token already ends it (its slot goes back to ``free_slots``)."""
        live.prefill_time = time.perf_counter() - tic
        self.prefill += live.prefill_time
        yield SlotStarted(
            live.slot,
            live.index,
            live.prompt_tokens,
            live.prefill_time,
            live.tokens[0],
            live.finish,
        )
        if live.finish is not None:
            free_slots.append(live.slot)
            yield SlotFinished(live.slot, live.index, self.finish(live, mode, B))

    def summary(
        self, mode: str, slots: int, n_requests: int, B: int | None, peak: float
    ) -> SlotsSummary:
        reqs = [self.done[i] for i in range(n_requests)]
        dflash = mode == "dflash"
        per_slot = []
        for s in range(slots):
            lives = self.by_slot[s]
            gen = sum(len(x.tokens) for x in lives)
            dt = sum(x.decode_time for x in lives)
            r = sum(x.rounds for x in lives)
            sa = sum(x.sum_a for x in lives)
            dr = sum(x.drafted for x in lives)
            hist = [sum(x.hist[k] for x in lives) for k in range(B)] if dflash and B else None
            tau, rate, _ = pooled_acceptance(sa, r, dr) if dflash else (None,) * 3
            per_slot.append(
                SlotStats(
                    slot=s,
                    requests=tuple(x.index for x in lives),
                    generation_tokens=gen,
                    decode_time=dt,
                    generation_tps=tokens_per_s(gen - len(lives), dt),
                    rounds=r,
                    tau=tau,
                    acceptance_rate=rate,
                    accepted_histogram=hist,
                )
            )
        gen = sum(s.generation_tokens for s in reqs)
        ptoks = sum(s.prompt_tokens for s in reqs)
        n = self.n_row_rounds
        tau, rate, share = (
            pooled_acceptance(self.sum_a, n, self.sum_drafted) if dflash else (None,) * 3
        )
        return SlotsSummary(
            mode=mode,
            slots=slots,
            requests=reqs,
            per_slot=per_slot,
            rounds=self.rounds,
            prompt_tokens=ptoks,
            generation_tokens=gen,
            prefill_time=self.prefill,
            decode_time=self.decode,
            prompt_tps=ptoks / self.prefill if self.prefill > 0 else 0.0,
            generation_tps=tokens_per_s(gen - len(reqs), self.decode),
            peak_memory_gb=peak,
            round_times=list(self.round_times),
            row_rounds=self.n_row_rounds,
            block_size=B if dflash else None,
            tau=tau,
            acceptance_rate=rate,
            draft_share=share,
            accepted_histogram=list(self.hist) if dflash else None,
            t_draft=self.t_draft if dflash else None,
            t_verify=self.t_verify if dflash else None,
            t_rollback=self.t_roll if dflash else None,
        )


# ---- DFlash -------------------------------------------------------------------------------------
def slots_dflash_generate(
    target: TargetModel,
    drafter: DFlashDraftModel,
    requests: Iterable[Request | Sequence[int]],
    *,
    slots: int,
    sampling: SamplingParams | None = None,
    block_size: int | None = None,
    eos_token_ids: Iterable[int] = (),
    idle: str = "compact",
    prefill_step_size: int = PREFILL_STEP_SIZE,
    lookup: bool = False,
    lagged: bool | None = None,
    device_lookup: bool | None = None,
    draft_ahead: bool | None = None,
) -> Iterator[SlotEvent]:
    """Decode ``requests`` with DFlash, up to ``slots`` at a time; yield events.

    Args:
        target: the target model; ``drafter`` is bound to its embedding and head if not yet.
        drafter: the DFlash drafter (validated against the target by the caller).
        requests: :class:`Request` objects (or bare prompts, ``max_tokens`` 256), served in order.
        slots: N, the most requests decoded together.
        sampling: temperature / top-p / top-k / seed; default greedy.
        block_size: B, 2..drafter.block_size; default the drafter's.
        eos_token_ids: tokens that stop a request (included in its tokens).
        idle: ``"compact"`` (drop rows without work from the batch) or ``"keep"``.
        lookup: a row may verify the continuation of its own last n-gram instead of the
            drafter's tokens (:mod:`hf2q.runtime.lookup`, per row); greedy outputs are
            unchanged and sampled ones keep the target's distribution.
        lagged: queue the next round before reading the current one's acceptance; with
            ``lookup`` only while no row's lookup proposal is due (those rounds are
            synchronous: a proposal needs the row's latest tokens). None:
            ``hf2q.kernels.select.lagged_for(lookup)`` (``HF2Q_LAGGED_ROUNDS``, on CUDA only;
            with lookup also ``HF2Q_LAGGED_LOOKUP``, off). Same greedy tokens; sampled ones
            from the same distribution.
        device_lookup: with ``lookup`` and ``lagged``, greedy: the rows' proposals and
            choices are built on the device (:class:`~hf2q.runtime.lookup.RowsLookup`), so the
            rounds stay lagged while proposals are due. None: ``HF2Q_LAGGED_LOOKUP=device``.
        draft_ahead: every row busy: a synchronous round queues the next round's drafter
            (this round's features with its kept counts as context, its bonus tokens as
            blocks) before reading its own acceptance, and the next round verifies those
            drafts where a row does not pick its lookup proposal. Sampled, each row's draft is
            drawn with the key its next drafted round takes, so a seed gives the tokens of a
            synchronous run wherever the row's block is whole (a row's last, shorter blocks
            keep the first positions of a whole block's draw). None: ``HF2Q_DRAFT_AHEAD``.

    Raises:
        UsageError: bad slot count, empty prompt, ``max_tokens < 1``, block size out of range.
    """
    sampling = sampling or SamplingParams()
    reqs = _check(list(requests), slots, sampling, idle)
    B = drafter.block_size if block_size is None else int(block_size)
    if not 2 <= B <= drafter.block_size:
        raise UsageError(
            f"--block-size must be between 2 and the drafter's block size {drafter.block_size}, got {B}"
        )
    if not drafter.is_bound:
        drafter.bind(target.embed, target.head)
    return _dflash_slots(
        target,
        drafter,
        reqs,
        slots,
        sampling,
        B,
        frozenset(eos_token_ids),
        idle,
        prefill_step_size,
        lookup,
        lagged_for(lookup) if lagged is None else lagged,
        (lagged_lookup_mode() == "device") if device_lookup is None else device_lookup,
        draft_ahead_enabled() if draft_ahead is None else draft_ahead,
    )


def _dflash_slots(
    target: TargetModel,
    drafter: DFlashDraftModel,
    reqs: list[Request],
    slots: int,
    sampling: SamplingParams,
    B: int,
    eos: frozenset[int],
    idle: str,
    step_size: int,
    lookup: bool = False,
    lagged: bool = False,
    device_lookup: bool = False,
    draft_ahead: bool = False,
) -> Iterator[SlotEvent]:
    mask_id = drafter.mask_token_id
    # Lagged rounds keep going while lookup proposals are due: built on the device (greedy).
    device_lookup = device_lookup and lookup and lagged and sampling.greedy
    ids = drafter.config.target_layer_ids
    mx.reset_peak_memory()
    tcache = make_slot_target_cache(target, slots)
    dcache = make_slot_draft_cache(drafter, slots)
    rows: list[_Live | None] = [None] * slots  # row -> the request it decodes (None: idle)
    free_slots = deque(range(slots))
    queue = deque(enumerate(reqs))
    ctx: mx.array | None = None  # (R, S, n_ids*H) new drafter context per row
    ctx_len = [1] * slots  # rows of ``ctx`` each row appends
    st = _Stats(slots, B)
    graphs: list[CompiledVerify | None] = []  # what whole() decided
    dgraph = drafter.graph(B)  # the drafts of full blocks as one graph (HF2Q_COMPILE_DRAFT=1)
    words_on = round_words_enabled()  # rounds read as 8-byte words (hf2q.kernels.cuda_readback)

    def round_words(
        vocab: int,
        draft: mx.array,
        a_arr: mx.array,
        bonus: mx.array,
        use: mx.array | None = None,
        marks: Sequence[tuple[mx.array, list[int]]] = (),
        caches: Sequence[SlotKVCache] = (),
    ) -> tuple[cuda_readback.Words | None, list[int]]:
        """A round's outcome (tokens below ``vocab``; with the attention offsets of ``marks``,
        of ``caches`` in a lagged round) as words the host reads in place, and for each mark
        which offset of the words is its own; None where the words are off or cannot hold it
        (the arrays are read instead)."""
        if not words_on:
            return None, []
        offs: list[mx.array] = []  # the distinct offset arrays (layers share one)
        where = []
        for off, _ in marks:
            if not any(off is o for o in offs):
                offs.append(off)
            where.append(next(j for j, o in enumerate(offs) if o is off))
        bound = max((max(c.lengths, default=0) for c in caches), default=0)
        rnd = cuda_readback.RoundArrays(draft, a_arr, bonus, use, offs)
        return cuda_readback.words_of(rnd, max(vocab, mask_id + 1), bound), where

    def read_words(
        words: cuda_readback.Words,
    ) -> tuple[list[int], list[int], list[list[int]], list[cuda_readback.RowOutcome]]:
        """(accepted, bonus, accepted drafts, the rows' outcomes) of a round's words; rows
        without a request read only their word 0."""
        got = words.read([x is not None for x in rows])
        acc = [g.accepted for g in got]
        bonus = [g.committed[-1] if g.committed else mask_id for g in got]
        return acc, bonus, [g.committed[:-1] for g in got], got

    def whole() -> CompiledVerify | None:
        """The verify of the rows' full blocks as one compiled graph (:func:`whole_verify`; CUDA),
        decided at the first verify, once the rows hold their prompts."""
        if not graphs:
            graphs.append(whole_verify(target, tcache, B, ids))
        return graphs[0]

    def sample_drafts(
        dlogits: mx.array | None,
        n_row: list[int],
        picked: list | None = None,
        width: int = 0,
        ahead: tuple[mx.array, list[mx.array] | None] | None = None,
        peek: bool = False,
    ) -> tuple[mx.array, list[mx.array | None]]:
        """Sampled drafts (R, width) of each busy row's first ``n_row[r]`` positions (padded with
        the mask token), or its lookup proposal ``picked[r]``, and each row's q (None for idle
        rows and for proposals: :func:`accept` puts all of q's mass on a proposal's tokens),
        with the row's own keys. ``dlogits`` None: every busy row has a proposal, or its
        draft queued ahead (``ahead``: drafts and q per row, drawn with the key taken here).
        ``peek``: drawn with each row's next key without taking it (a draft queued ahead)."""
        if dlogits is not None:
            width = dlogits.shape[1]
            dlogits = drafter.full_logits(dlogits)
        drafts, q_rows = [], []
        for r, x in enumerate(rows):
            if x is None:
                drafts.append(mx.full((width,), mask_id, dtype=mx.int32))
                q_rows.append(None)
                continue
            n = n_row[r]
            if picked is not None and picked[r] is not None:  # a lookup proposal
                d, q = mx.array(picked[r], dtype=mx.int32), None
            elif ahead is not None:
                x.keys.next()  # the key the draft queued ahead was drawn with
                d, q = ahead[0][r, :n], ahead[1][r][:n]
            else:
                q = probs(dlogits[r, :n], sampling)
                key = x.keys.peek() if peek else x.keys.next()
                d = mx.random.categorical(mx.log(q), axis=-1, key=key)
            pad = mx.full((width - n,), mask_id, dtype=mx.int32)
            drafts.append(mx.concatenate([d.astype(mx.int32), pad]))
            q_rows.append(q)
        return mx.stack(drafts), q_rows

    # Each row's draft limit as an array, made once per list of limits (the same every lagged
    # round): not a host array and its pieces (``host_ints``) every round.
    limits: dict[tuple[int, ...], mx.array] = {}
    greedy_launch = sampling.greedy and accept_kernel_enabled()  # (read once a generation)

    def accept(
        draft: mx.array, q_rows: list[mx.array | None], vlogits: mx.array, n_row: list[int]
    ) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
        """Each row's accepted drafts (at most ``n_row[r]``), bonus token and kept count (the
        accepted drafts + 1), on the device: greedy (in one launch where
        ``accept_kernel_enabled``), or rejection sampling with the row's keys (idle rows: 0
        and the mask token); and, from the launch after full blocks, the drafter's next blocks
        (the bonus token, then mask tokens: :func:`block_logits` takes them), else None."""
        if sampling.greedy:
            key = tuple(n_row)
            if key not in limits:
                if len(limits) >= 64:
                    limits.clear()
                limits[key] = host_ints(n_row)
            choice = mx.argmax(vlogits, axis=-1)  # (R, bs)
            if greedy_launch:
                a, bonus, keep, blocks = accept_greedy_cuda(draft, choice, limits[key], mask_id)
                return a, bonus, keep, blocks if draft.shape[1] == B - 1 else None
            a, bonus = accept_greedy(draft, choice.astype(mx.int32), limits[key])
            return a, bonus, a + 1, None
        a_l, b_l = [], []
        for r, x in enumerate(rows):
            if x is None:
                a_l.append(mx.array(0, dtype=mx.int32))
                b_l.append(mx.array(mask_id, dtype=mx.int32))
                continue
            n = n_row[r]
            p = probs(vlogits[r, : n + 1], sampling)
            q = q_rows[r]
            if q is None:  # a lookup proposal: all of q's mass on each token
                q = point_masses(draft[r, :n], p.shape[-1])
            a, b = accept_rejection(draft[r, :n], q, p, x.keys.next())
            a_l.append(a.astype(mx.int32))
            b_l.append(b.astype(mx.int32))
        a = mx.stack(a_l)
        return a, mx.stack(b_l), a + 1, None

    def submit(
        ahead: tuple[mx.array, list[mx.array] | None] | None = None,
    ) -> tuple[mx.array, list[mx.array | None], list[int], list[int], list[str], bool, float]:
        """Queue the drafter forward for every row; return (draft (R, B_r-1), q per row (T > 0),
        drafts each row may accept + 1, last tokens, who drafted each row, whether the drafter
        was skipped, host seconds). When every busy row verifies its lookup proposal the
        drafter does not run: it is given this round's context rows with the next round's
        (:func:`join_rows`), as the single-sequence loop does. ``ahead``: the drafter's tokens
        (R, B-1) and (sampled) each row's q, already queued by the last round (see
        ``draft_ahead``)."""
        tic = time.perf_counter()
        bs_row = [min(B, x.remaining + 1) if x is not None else 2 for x in rows]
        bs = max(bs_row)
        last = [x.tokens[-1] if x is not None else mask_id for x in rows]
        picked = [  # rows whose lookup proposal is verified instead of their drafted tokens
            x.chooser.proposal(bs_row[r] - 1) if x is not None and x.chooser else None
            for r, x in enumerate(rows)
        ]
        sources = ["lookup" if pr is not None else "drafter" for pr in picked]
        skip = ahead is None and all(pr is not None for x, pr in zip(rows, picked) if x is not None)
        dlogits = None
        if ahead is None and not skip:
            for c in dcache:
                c.prepare(lengths=ctx_len)
            block = mx.concatenate([host_ints(last)[:, None], mask_rows(len(rows))[:, : bs - 1]], 1)
            dlogits = drafter(block, ctx, dcache, dgraph)  # (R, bs-1, V)
        q_rows: list[mx.array | None] = []
        if sampling.greedy:
            if ahead is not None:
                draft = ahead[0][:, : bs - 1]
            else:
                draft = None if dlogits is None else drafter.proposals(dlogits)
            if any(pr is not None for pr in picked):  # always so when the drafter was skipped
                pad = [mask_id] * (bs - 1)
                lk = mx.array([(pr or []) + pad[len(pr or []) :] for pr in picked], dtype=mx.int32)
                use = mx.array([pr is not None for pr in picked])
                draft = lk if draft is None else mx.where(use[:, None], lk, draft)
        else:
            n_row = [b - 1 for b in bs_row]
            draft, q_rows = sample_drafts(dlogits, n_row, picked, bs - 1, ahead)
        mx.async_eval(draft)
        return draft, q_rows, bs_row, last, sources, skip, time.perf_counter() - tic

    def commit_round(
        acc: list[int],
        bonus: list[int],
        draft_host: list[list[int]],
        bs_row: list[int],
        sources: list[str],
        times: tuple[float, float, float, float],
        bs: int,
    ) -> tuple[SlotRound, list[int]]:
        """Commit one round's tokens to its busy rows and count it; return (event, rows that
        finished). ``times``: (round, draft, verify, rollback) seconds."""
        dt, t_draft, t_verify, t_roll = times
        st.rounds += 1
        st.round_times.append(dt)
        st.decode += dt
        st.t_draft += t_draft
        st.t_verify += t_verify
        st.t_roll += t_roll
        busy_slots, accepted, committed, finished, bonuses, drafted_by = [], [], [], [], [], []
        for r, x in enumerate(rows):
            if x is None:
                continue
            a = acc[r]
            bonuses.append(bonus[r])
            drafted_by.append(sources[r])
            kept = x.commit(draft_host[r][:a] + [bonus[r]], eos)
            if x.chooser is not None:
                x.chooser.round_done(sources[r], a, kept)
            x.rounds += 1
            x.sum_a += a
            x.drafted += bs_row[r] - 1
            x.hist[a] += 1
            x.decode_time += dt
            x.t_draft += t_draft
            x.t_verify += t_verify
            x.t_rollback += t_roll
            st.sum_a += a
            st.sum_drafted += bs_row[r] - 1
            st.n_row_rounds += 1
            st.hist[a] += 1
            busy_slots.append(x.slot)
            accepted.append(a)
            committed.append(kept)
            if x.finish is not None:
                finished.append(r)
        event = SlotRound(
            index=st.rounds,
            slots=tuple(busy_slots),
            block_size=bs,
            accepted=tuple(accepted),
            committed=tuple(committed),
            rows=len(rows),
            t_draft=t_draft,
            t_verify=t_verify,
            t_rollback=t_roll,
            elapsed=st.decode,
            finished=tuple(rows[r].slot for r in finished),
            bonus=tuple(bonuses),
            sources=tuple(drafted_by),
        )
        return event, finished

    def release(finished: list[int]) -> Iterator[SlotEvent]:
        for r in finished:
            x = rows[r]
            rows[r] = None
            free_slots.append(x.slot)
            yield SlotFinished(x.slot, x.index, st.finish(x, "dflash", B))

    blocks_of_masks: dict[int, mx.array] = {}

    def mask_rows(R: int) -> mx.array:
        """(R, B-1) mask tokens, a full block after its first token: made once per row count
        (not a new array, and a kernel on a GPU, every round)."""
        if R not in blocks_of_masks:
            blocks_of_masks[R] = mx.full((R, B - 1), mask_id, dtype=mx.int32)
        return blocks_of_masks[R]

    def block_logits(
        first: mx.array,
        context: mx.array,
        counts: list[int] | mx.array,
        masks: mx.array,
        block: mx.array | None = None,
    ) -> mx.array:
        """The drafter's logits (R, B-1, V) for full blocks (each row's ``first`` token, then
        ``masks``; or ``block``, those blocks already joined) after each row appends its
        ``counts`` rows of ``context`` (a list, or an array only the device has read: lagged
        caches)."""
        for c in dcache:
            c.prepare(lengths=counts)
        if block is None:
            block = mx.concatenate([first[:, None], masks], axis=1)
        return drafter(block, context, dcache, dgraph)

    def lookup_due() -> bool:
        """Whether a row would draft its next round from its lookup proposal (``lookup=True``):
        such a round needs the row's latest tokens, so it runs synchronously."""
        return lookup and any(
            x is not None and x.chooser is not None and x.chooser.proposal(B - 1) is not None
            for x in rows
        )

    def next_lagged() -> bool:
        """Whether the next round is a lagged one: lagged rounds are on, and no row's lookup
        proposal is due (or the proposals are built on the device)."""
        return lagged and (device_lookup or not lookup_due())

    def lagged_rounds() -> Iterator[SlotEvent]:
        """Rounds over the current rows, each queued before the previous one's acceptance is
        read, until a row finishes (or, with lookup, a row's lookup proposal is due); then the
        round in flight is read too, the caches' bounds made exact, and control goes back to
        the scheduler.

        Everything a round needs from the last one stays on the device: the bonus tokens (the
        next blocks' first tokens), the verify's features with the kept counts (the drafter's
        new context, appended ragged), the kept counts (the target's rollback). So the host
        builds round k+1 while the device computes round k, as plain decoding queues its next
        step, instead of waiting for round k's acceptance first. At T > 0 drafts and acceptance
        are sampled per row on the device with the row's keys in the synchronous order. Every
        block is B long (a row near its end may accept past ``max_tokens``; its commit stops
        there, as always; sampled, the last rounds then draw other values than a synchronous
        run, from the same distribution); the time split is host building (draft) and waiting
        (verify), no rollback share.
        """
        nonlocal ctx, ctx_len
        R = len(rows)
        last = mx.array([x.tokens[-1] if x else mask_id for x in rows], dtype=mx.int32)
        masks = mask_rows(R)
        next_blocks = None  # the next blocks as the acceptance launch wrote them, or None
        kv = [c for c in (*tcache, *dcache) if isinstance(c, SlotKVCache)]
        for c in kv:
            c.lagged = True
        looked = None  # the rows' lookup on the device (device_lookup)
        if device_lookup:
            room = max((x.remaining for x in rows if x is not None), default=0)
            looked = RowsLookup([x.chooser if x else None for x in rows], B - 1, room)
        flight: deque = deque()
        t_prev = time.perf_counter()
        stop = False
        draft_first = lagged_draft_first()
        depth = lag_depth()
        while flight or not stop:
            if not stop:
                tic = time.perf_counter()
                dlogits = block_logits(last, ctx, ctx_len, masks, next_blocks)  # (R, B-1, V)
                use = None
                if sampling.greedy:
                    draft, q_rows = drafter.proposals(dlogits), []
                    if looked is not None:  # rows whose chooser picks their proposal
                        proposed, use = looked.propose()
                        draft = mx.where(use[:, None], proposed, draft)
                else:  # each row's keys in the order a synchronous round draws them
                    draft, q_rows = sample_drafts(dlogits, [B - 1] * R)
                if draft_first:  # the device drafts while the host builds the verify
                    mx.async_eval(draft, [q for q in q_rows if q is not None])
                vin = mx.concatenate([last[:, None], draft], axis=1)
                vlogits, feats = verify_forward(
                    target, vin, tcache, capture=ids, lagged=True, whole=whole()
                )
                a_arr, last, keep, next_blocks = accept(draft, q_rows, vlogits, [B - 1] * R)
                tcache.rollback(keep)
                ctx, ctx_len = feats, keep
                marks = [c.mark() for c in kv]
                extra = []
                if looked is not None:
                    looked.update(draft, a_arr, last, use)
                    extra = [use, looked.state]
                words, where = round_words(vlogits.shape[-1], draft, a_arr, last, use, marks, kv)
                mx.async_eval(
                    draft,
                    a_arr,
                    last,
                    ctx,
                    tcache.state,
                    [c.state for c in dcache],
                    extra,
                    words.rows if words else [],
                )
                flight.append(
                    (draft, a_arr, last, use, marks, words, where, time.perf_counter() - tic)
                )
                if len(flight) < depth:
                    continue
            draft_o, a_o, bonus_o, use_o, marks_o, words_o, where_o, t_build = flight.popleft()
            t1 = time.perf_counter()
            sources = ["drafter"] * R
            if words_o is not None:
                acc, bonus, draft_host, got = read_words(words_o)
                if use_o is not None:
                    sources = ["lookup" if g.looked_up else "drafter" for g in got]
                for c, m, j in zip(kv, marks_o, where_o, strict=True):
                    c.resync(m, [g.offsets[j] for g in got])
            else:
                acc, bonus, draft_host = a_o.tolist(), bonus_o.tolist(), draft_o.tolist()
                if use_o is not None:  # the host choosers follow the device's choices
                    sources = ["lookup" if u else "drafter" for u in use_o.tolist()]
                for c, m in zip(kv, marks_o, strict=True):
                    c.resync(m)
            t2 = time.perf_counter()
            times = (t2 - t_prev, t_build, t2 - t1, 0.0)
            t_prev = t2
            event, finished = commit_round(acc, bonus, draft_host, [B] * R, sources, times, B)
            yield event
            yield from release(finished)
            stop = stop or bool(finished) or all(x is None for x in rows)
            stop = stop or (looked is None and lookup_due())
        for c in kv:  # every round read: the bounds are exact again
            c.lagged = False
        ctx_len = [int(v) for v in ctx_len.tolist()] if isinstance(ctx_len, mx.array) else ctx_len

    pending = None  # the next round's queued draft (same rows), or None
    carried = None  # drafts queued ahead by a round some rows finished in (compact: see below)
    while True:
        # -- fill idle rows from the queue (each request prefilled alone) ----------------------
        for r in range(len(rows)):
            while rows[r] is None and queue:
                pending = carried = None  # the rows change: the next draft is queued afresh
                index, req = queue.popleft()
                slot = free_slots.popleft()
                tic = time.perf_counter()
                keys = _keys(req, index, sampling)
                one_t = make_target_cache(target)
                one_d = drafter.make_cache()
                logits, feat = prefill(
                    target,
                    req.prompt,
                    one_t,
                    drafter=drafter,
                    draft_cache=one_d,
                    step_size=step_size,
                )
                first = choose(logits, sampling, keys)
                mx.eval(first, feat)
                live = _Live(index, slot, len(req.prompt), req.max_tokens, keys, 0.0, [])
                live.hist = [0] * B
                live.commit([int(first.item())], eos)
                if lookup:
                    live.chooser = LookupChooser([*req.prompt, *live.tokens])
                if live.finish is None:
                    tcache.insert(r, one_t)
                    insert_draft_rows(dcache, r, one_d)
                    if ctx is None:
                        ctx = mx.zeros((len(rows), 1, feat.shape[-1]), dtype=feat.dtype)
                    ctx[r : r + 1, :1] = feat
                    ctx_len[r] = 1
                    mx.eval(tcache.state, [c.state for c in dcache], ctx)
                    rows[r] = live
                yield from st.started(live, tic, free_slots, "dflash", B)
        busy = [r for r, live in enumerate(rows) if live is not None]
        if not busy:
            break
        if idle == "compact" and len(busy) < len(rows):
            pending = None
            tcache.filter(busy)
            for c in dcache:
                c.filter(busy)
            rows = [rows[r] for r in busy]
            idx = mx.array(busy, dtype=mx.int32)
            ctx = ctx[idx]
            ctx_len = [ctx_len[r] for r in busy]
            if carried is not None:  # the rows left keep the drafts queued ahead for them
                drafts, q = carried
                kept = drafts[idx]
                pending = submit((kept, None if q is None else [q[r] for r in busy]))
        carried = None

        # A draft already queued means the last round found a lookup proposal due, or drafted
        # ahead (same rows).
        if pending is None and next_lagged():
            yield from lagged_rounds()
            continue

        # -- one round over all rows -----------------------------------------------------------
        # As the single-sequence loop, a round's draft is queued before the previous round's
        # event is handed out when the rows stay the same, so it runs on the device meanwhile;
        # the host time spent queuing it counts in this round's draft time.
        t0 = time.perf_counter()
        queued = pending is not None
        if not queued:
            pending = submit()
        draft, q_rows, bs_row, last, sources, skipped, t_submit = pending
        pending = None
        t_pre = t_submit if queued else 0.0  # queuing time spent before t0
        bs = draft.shape[1] + 1

        vin = mx.concatenate([host_ints(last)[:, None], draft], axis=1)  # (R, bs)
        vlogits, feats = verify_forward(target, vin, tcache, capture=ids, whole=whole())
        a_arr, bonus_arr, keep_arr, next_blocks = accept(
            draft, q_rows, vlogits, [b - 1 for b in bs_row]
        )
        # Read below without a copy (one of a larger array would wait for a draft queued ahead).
        words, _ = round_words(vlogits.shape[-1], draft, a_arr, bonus_arr)
        ahead = held = None
        if draft_ahead and "drafter" in sources and all(x is not None for x in rows):
            # The next round's drafter, queued before this round is read: the device drafts
            # while the host reads, commits and picks the rows' proposals. Its context is this
            # round's features with the kept counts (on the device: the drafter's caches are
            # lagged until the counts are read), its blocks start with the bonus tokens. The
            # verify is queued first, on its own: reading it does not wait for the drafter.
            # Not after a round every row verified from its lookup proposal: such rounds come
            # in runs, and drafting after the read lets the next one skip the drafter. (Drafting
            # ahead after every round, the demo pair's 1-slot rounds in hf2q bench were 0.7-1.1
            # ms longer on an H200; over the built-in prompts the drafter ran 204 times in 196
            # rounds against 126 drafting after the read, and 151 with this condition.)
            mx.async_eval(draft, a_arr, bonus_arr, feats, words.rows if words else [])
            held = [list(c.lengths) for c in dcache]
            for c in dcache:
                c.lagged = True
            dlogits = block_logits(bonus_arr, feats, keep_arr, mask_rows(len(rows)), next_blocks)
            if sampling.greedy:
                ahead = (drafter.proposals(dlogits), None)
            else:  # each row's draft with the key its next drafted round takes (none if the
                # row picks its lookup proposal then, as in a synchronous round)
                ahead = sample_drafts(dlogits, [B - 1] * len(rows), peek=True)
            mx.async_eval(ahead[0], ahead[1] or [], [c.state for c in dcache])
        mx.eval(draft)
        t1 = time.perf_counter()
        mx.eval(a_arr, bonus_arr, words.rows if words else [])
        if words is not None:
            acc, bonus, draft_host, _ = read_words(words)
        else:
            acc, bonus, draft_host = a_arr.tolist(), bonus_arr.tolist(), None
        t2 = time.perf_counter()

        keep = [acc[r] + 1 if x is not None else 1 for r, x in enumerate(rows)]
        tcache.rollback(keep)
        if ahead is not None:  # the drafter has this round's kept rows: no new context
            for c, n in zip(dcache, held, strict=True):  # its caches exact again
                c.settle([a + k for a, k in zip(n, keep)])
            ctx, ctx_len = feats[:, :1], [0] * len(rows)
        elif skipped:  # the drafter has not seen ``ctx`` yet: these rows follow it, per row
            ctx, ctx_len = join_rows(ctx, ctx_len, feats, keep)
        else:
            ctx = feats[:, : max(keep)]
            ctx_len = keep
        # Materialise the restored states while the host goes on to build the next draft.
        mx.async_eval(ctx, tcache.state)
        t3 = time.perf_counter()

        times = (t3 - t0 + t_pre, t1 - t0 + t_pre, t2 - t1, t3 - t2)
        draft_host = draft.tolist() if draft_host is None else draft_host
        event, finished = commit_round(acc, bonus, draft_host, bs_row, sources, times, bs)
        if not finished and ahead is not None:  # the same rows: their drafts are queued
            pending = submit(ahead)
        elif ahead is not None and idle == "compact":  # valid for the rows that go on, unless
            carried = ahead  # a queued request takes a finished row's place
        elif not finished and not next_lagged():  # (a lagged round queues its own draft)
            pending = submit()  # runs on the device while the event is consumed
        yield event
        yield from release(finished)

    yield st.summary("dflash", slots, len(reqs), B, mx.get_peak_memory() / 1e9)


def join_rows(
    a: mx.array, a_len: list[int], b: mx.array, b_len: list[int]
) -> tuple[mx.array, list[int]]:
    """Per row r, ``a[r, :a_len[r]]`` followed by ``b[r, :b_len[r]]``, left-aligned in one
    (R, max total, ...) array (positions past a row's total hold its first row: callers
    read only a row's first ``total[r]``); returns it with the totals."""
    S = a.shape[1]
    total = [x + y for x, y in zip(a_len, b_len)]
    width = max(total)
    idx = [
        [j if j < n else (S + j - n if j < t else 0) for j in range(width)]
        for n, t in zip(a_len, total)
    ]
    both = mx.concatenate([a, b], axis=1)
    ix = mx.array(idx, dtype=mx.int32).reshape(len(idx), width, *([1] * (a.ndim - 2)))
    return mx.take_along_axis(both, ix, axis=1), total


# ---- plain --------------------------------------------------------------------------------------
def slots_plain_generate(
    target: TargetModel,
    requests: Iterable[Request | Sequence[int]],
    *,
    slots: int,
    sampling: SamplingParams | None = None,
    eos_token_ids: Iterable[int] = (),
    idle: str = "compact",
    prefill_step_size: int = PREFILL_STEP_SIZE,
) -> Iterator[SlotEvent]:
    """Decode ``requests`` one token per row per step, up to ``slots`` rows; yield events.

    The same scheduling, prefill, caches and stop rules as :func:`slots_dflash_generate`, with
    the single-sequence plain step's computation (mlx-lm's model call, or ``decode_layer_fn``).
    Like ``hf2q.runtime.dflash.plain_generate`` the next step is queued with ``mx.async_eval``
    before the current tokens are read; rows that finish meanwhile are overwritten (new request)
    or dropped (compaction) before their garbage is used.
    """
    sampling = sampling or SamplingParams()
    reqs = _check(list(requests), slots, sampling, idle)
    return _plain_slots(
        target, reqs, slots, sampling, frozenset(eos_token_ids), idle, prefill_step_size
    )


def _plain_slots(
    target: TargetModel,
    reqs: list[Request],
    slots: int,
    sampling: SamplingParams,
    eos: frozenset[int],
    idle: str,
    step_size: int,
) -> Iterator[SlotEvent]:
    model = target.model
    mx.reset_peak_memory()
    tcache: SlotTargetCache = make_slot_target_cache(target, slots)
    rows: list[_Live | None] = [None] * slots
    free_slots = deque(range(slots))
    queue = deque(enumerate(reqs))
    st = _Stats(slots, 1)
    # ``cur[r]`` is read each iteration: the token row r's last step generated, except for rows
    # in ``fresh``, where it is the row's first token (already committed), fed in as input.
    cur: mx.array | None = None
    fresh: set[int] = set()
    # ``cur`` as words the host reads without a copy (hf2q.kernels.cuda_readback; from 3 rows,
    # where ``cur`` is more than 8 bytes and its read would wait for the step queued behind it).
    cur_words: cuda_readback.Words | None = None
    words_on = round_words_enabled()

    layer_fn = decode_layer_fn()  # hf2q's compiled layers on CUDA, as single-sequence decoding
    mm = small_mm_enabled()  # the head's product, read once as the layers' is

    def step(y: mx.array) -> tuple[mx.array, cuda_readback.Words | None]:
        """The next tokens (R,) and, where they are read as words, their words."""
        if layer_fn is None:
            logits = model(y[:, None], cache=tcache)[:, -1]  # (R, V)
        else:
            logits = target.forward(y[:, None], tcache, layer_fn=layer_fn, mm=mm)[0][:, -1]
        if sampling.greedy:
            tok = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            picks = [
                choose(logits[r : r + 1], sampling, x.keys)
                if x is not None
                else mx.zeros((1,), mx.int32)
                for r, x in enumerate(rows)
            ]
            tok = mx.concatenate(picks)
        many = words_on and tok.shape[0] > 2
        return tok, cuda_readback.token_words(tok, logits.shape[-1]) if many else None

    def fill() -> Iterator[SlotEvent]:
        nonlocal cur
        for r in range(len(rows)):
            while rows[r] is None and queue:
                index, req = queue.popleft()
                slot = free_slots.popleft()
                tic = time.perf_counter()
                keys = _keys(req, index, sampling)
                one = make_target_cache(target)
                logits, _ = prefill(target, req.prompt, one, step_size=step_size)
                first = choose(logits, sampling, keys)
                mx.eval(first)
                live = _Live(index, slot, len(req.prompt), req.max_tokens, keys, 0.0, [])
                live.commit([int(first.item())], eos)
                if live.finish is None:
                    # The row's caches are replaced after any step already queued, so that
                    # step's garbage for this row is overwritten; its value in ``cur`` too.
                    # (Lazy: the copy runs with the next step, which it must follow.)
                    tcache.insert(r, one)
                    if cur is not None:
                        cur[r] = live.tokens[0]
                    fresh.add(r)
                    rows[r] = live
                yield from st.started(live, tic, free_slots, "plain", None)

    yield from fill()
    t_prev = time.perf_counter()
    while True:
        busy = [r for r, x in enumerate(rows) if x is not None]
        if not busy:
            break
        if cur is None:  # nothing queued: feed every busy row its last token
            cur = mx.array([x.tokens[-1] if x is not None else 0 for x in rows], dtype=mx.int32)
            cur_words = None
            fresh = set(busy)
        if idle == "compact" and len(busy) < len(rows):
            tcache.filter(busy)
            rows = [rows[r] for r in busy]
            cur = cur[mx.array(busy, dtype=mx.int32)]
            cur_words = None
            fresh = {busy.index(r) for r in fresh}
        # Queue the following step before reading ``cur`` if some row can still use it.
        go_on = any(
            x is not None and x.remaining >= (1 if r in fresh else 2) for r, x in enumerate(rows)
        )
        nxt, nxt_words = step(cur) if go_on else (None, None)
        if nxt is not None:
            mx.async_eval(nxt, nxt_words.rows if nxt_words else [])
        toks = cur_words.tokens() if cur_words is not None else cur.tolist()
        now = time.perf_counter()
        dt = now - t_prev
        t_prev = now
        busy_slots, committed, finished = [], [], []
        for r, x in enumerate(rows):
            if x is None or r in fresh:
                continue
            kept = x.commit([toks[r]], eos)
            x.rounds += 1
            x.decode_time += dt
            st.n_row_rounds += 1
            busy_slots.append(x.slot)
            committed.append(kept)
            if x.finish is not None:
                finished.append(r)
        fresh = set()
        cur, cur_words = nxt, nxt_words
        if busy_slots:
            st.rounds += 1
            st.round_times.append(dt)
            st.decode += dt
            st.t_verify += dt
            yield SlotRound(
                index=st.rounds,
                slots=tuple(busy_slots),
                block_size=1,
                accepted=(0,) * len(busy_slots),
                committed=tuple(committed),
                rows=len(rows),
                t_draft=0.0,
                t_verify=dt,
                t_rollback=0.0,
                elapsed=st.decode,
                finished=tuple(rows[r].slot for r in finished),
            )
        for r in finished:
            x = rows[r]
            rows[r] = None
            free_slots.append(x.slot)
            yield SlotFinished(x.slot, x.index, st.finish(x, "plain", None))
        if finished and queue:
            t_fill = time.perf_counter()
            yield from fill()
            t_prev += time.perf_counter() - t_fill  # prefill is not decode time
    yield st.summary("plain", slots, len(reqs), None, mx.get_peak_memory() / 1e9)


def run_slots(events: Iterable[SlotEvent]) -> SlotsSummary:
    """Consume a generator of slot events and return its :class:`SlotsSummary`."""
    return final_event(events, SlotsSummary, "batched generation")


__all__ = [
    "IDLE_POLICIES",
    "Request",
    "SlotEvent",
    "SlotFinished",
    "SlotRound",
    "SlotStarted",
    "SlotStats",
    "SlotsSummary",
    "run_slots",
    "slots_dflash_generate",
    "slots_plain_generate",
]
