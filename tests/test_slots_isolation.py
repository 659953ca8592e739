"""Isolation: every slot decodes exactly what that prompt decodes alone.

At T = 0, for N in {1, 2, 4, 8} slots, with more requests than slots (continuous batching),
prompts of different lengths, requests stopping at different times (EOS and different
max_tokens), drafters fitted to agree with the target (long acceptances) and random ones
(rejections): each request's tokens from batched DFlash equal its single-sequence DFlash run and
plain greedy decoding, and batched plain decoding equals single plain decoding. At T > 0 with
block size 2 (all rows draft alike) each request samples exactly what a single run with the same
seed samples. Float32 tiny targets, as the single-sequence fidelity tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIT_TEXTS, load_fitted

from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.runtime.dflash import dflash_generate, plain_generate, run
from hf2q.runtime.sampling import SamplingParams
from hf2q.runtime.slots import (
    Request,
    SlotFinished,
    SlotRound,
    SlotsSummary,
    SlotStarted,
    run_slots,
    slots_dflash_generate,
    slots_plain_generate,
)

_cache: dict[tuple, tuple] = {}


def _pair(target_dir: Path, draft_dir: Path):
    key = (target_dir, draft_dir)
    if key not in _cache:
        lm, target, drafter = load_fitted(target_dir, draft_dir)
        _cache[key] = (lm.tokenizer, target, drafter)
    return _cache[key]


def _workload(tok, target) -> tuple[list[Request], list[int]]:
    """Eight requests: the fitted 4-token prompts plus longer ones, different max_tokens, and
    an EOS chosen from one continuation so that some requests stop early."""
    prompts = [tok.encode(t)[:4] for t in FIT_TEXTS[:5]]
    prompts += [
        tok.encode(FIT_TEXTS[0] + " " + FIT_TEXTS[3]),
        tok.encode("x"),
        tok.encode(FIT_TEXTS[4]),
    ]
    free = run(plain_generate(target, prompts[1], max_tokens=40)).tokens
    eos = [free[11]]
    maxes = [40, 37, 9, 33, 26, 21, 17, 30]
    return [Request(p, max_tokens=m) for p, m in zip(prompts, maxes)], eos


_expected: dict[tuple, list] = {}


def _expect(key, tok, target, drafter, reqs, eos, block_size=None):
    """Single-sequence plain greedy tokens, checked against single-sequence DFlash."""
    if key not in _expected:
        want = []
        for r in reqs:
            plain = run(
                plain_generate(target, r.prompt, max_tokens=r.max_tokens, eos_token_ids=eos)
            )
            one = run(
                dflash_generate(
                    target,
                    drafter,
                    r.prompt,
                    max_tokens=r.max_tokens,
                    eos_token_ids=eos,
                    block_size=block_size,
                )
            )
            assert one.tokens == plain.tokens
            want.append((plain.tokens, plain.finish_reason))
        _expected[key] = want
    return _expected[key]


def _check_batched(
    tok, target, drafter, reqs, eos, want, N, idle="compact", block_size=None, lagged=False
):
    events = list(
        slots_dflash_generate(
            target,
            drafter,
            reqs,
            slots=N,
            eos_token_ids=eos,
            idle=idle,
            block_size=block_size,
            lagged=lagged,
        )
    )
    summary = events[-1]
    assert isinstance(summary, SlotsSummary)
    for i, (s, (tokens, reason)) in enumerate(zip(summary.requests, want)):
        assert s.tokens == tokens, f"request {i}, {N} slots"
        assert s.finish_reason == reason
    # Each slot's rounds committed exactly its requests' tokens after their first.
    started = [e for e in events if isinstance(e, SlotStarted)]
    assert sorted(e.request for e in started) == list(range(len(reqs)))
    assert all(0 <= e.slot < N for e in started)
    per_request: dict[int, list[int]] = {e.request: [e.token] for e in started}
    slot_owner: dict[int, int] = {}
    for e in events:
        if isinstance(e, SlotStarted):
            slot_owner[e.slot] = e.request
        elif isinstance(e, SlotRound):
            assert len(set(e.slots)) == len(e.slots) <= N
            for slot, toks in zip(e.slots, e.committed):
                per_request[slot_owner[slot]].extend(toks)
    assert [per_request[i] for i in range(len(reqs))] == [w[0] for w in want]
    finished = [e for e in events if isinstance(e, SlotFinished)]
    assert sorted(e.request for e in finished) == list(range(len(reqs)))

    plain = run_slots(slots_plain_generate(target, reqs, slots=N, eos_token_ids=eos, idle=idle))
    assert [s.tokens for s in plain.requests] == [w[0] for w in want], f"plain, {N} slots"
    return summary, events


@pytest.mark.parametrize("N", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["qwen35", "qwen35_causal"])
def test_each_slot_decodes_exactly_its_single_run_with_agreeing_drafter(name, N, fitted_pairs):
    tok, target, drafter = _pair(*fitted_pairs[name])
    reqs, eos = _workload(tok, target)
    want = _expect(name, tok, target, drafter, reqs, eos)
    reasons = {w[1] for w in want}
    assert reasons == {"stop", "length"}  # requests really end both ways
    summary, events = _check_batched(tok, target, drafter, reqs, eos, want, N)
    rounds = [e for e in events if isinstance(e, SlotRound)]
    # The fitted drafter agreed: long acceptances happened inside batched rounds.
    assert max(a for e in rounds for a in e.accepted) >= 7
    assert max(len(e.slots) for e in rounds) == min(N, len(reqs))
    if len(reqs) > N:  # slots were reused by queued requests (continuous batching)
        slots_used = [e.slot for e in events if isinstance(e, SlotStarted)]
        assert len(slots_used) > len(set(slots_used))
    assert summary.tau is not None and summary.tau > 1.5
    assert sum(summary.accepted_histogram) == sum(len(e.slots) for e in rounds)


def test_lagged_rounds_switch_reads_the_environment(monkeypatch):
    monkeypatch.delenv(select.LAGGED_ROUNDS_ENV, raising=False)
    # On where async_eval returns once the graph is encoded (CUDA), off elsewhere.
    assert select.lagged_rounds_enabled() == (select.backend() == "cuda")
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "1")
    assert select.lagged_rounds_enabled() and "rounds lagged" in select.summary()
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "0")
    assert not select.lagged_rounds_enabled() and "rounds lagged" not in select.summary()
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "sometimes")
    with pytest.raises(UsageError, match="HF2Q_LAGGED_ROUNDS='sometimes' must be 0 or 1"):
        select.lagged_rounds_enabled()
    # With lookup drafts the rounds stay synchronous unless HF2Q_LAGGED_LOOKUP=1 (off).
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "1")
    monkeypatch.delenv(select.LAGGED_LOOKUP_ENV, raising=False)
    assert select.lagged_for(lookup=False) and not select.lagged_for(lookup=True)
    monkeypatch.setenv(select.LAGGED_LOOKUP_ENV, "1")
    assert select.lagged_for(lookup=True) and "with lookup" in select.summary()
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "0")
    assert not select.lagged_for(lookup=True) and not select.lagged_for(lookup=False)
    # A lagged round's draft is queued before its verify unless HF2Q_LAGGED_DRAFT_FIRST=0.
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, "1")
    first = select.LAGGED_DRAFT_FIRST_ENV
    _check_switch(monkeypatch, first, select.lagged_draft_first, True, "draft queued first")


def _check_switch(monkeypatch, env: str, enabled, default: bool, shown: str = "") -> None:
    """``enabled()`` follows ``env`` (unset: ``default``; 0/off, 1), ``shown`` is in
    ``--stats``'s summary exactly when it is on, and a bad value is refused naming ``env``."""
    for value, on in ((None, default), ("0", False), ("1", True), ("off", False)):
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        assert enabled() is on, (env, value)
        assert not shown or (shown in select.summary()) is on
    monkeypatch.setenv(env, "later")
    with pytest.raises(UsageError, match=f"{env}='later' must be 0 or 1"):
        enabled()
    monkeypatch.delenv(env)


def test_draft_ahead_switch_reads_the_environment(monkeypatch):
    # On where async_eval returns once the graph is encoded (CUDA), off elsewhere.
    on = select.backend() == "cuda"
    _check_switch(
        monkeypatch,
        select.DRAFT_AHEAD_ENV,
        select.draft_ahead_enabled,
        on,
        "next draft queued ahead",
    )


@pytest.mark.parametrize(
    ("N", "idle", "draft_first"),
    [(1, "compact", "0"), (3, "compact", "0"), (8, "keep", "0"), (3, "compact", "1")],
)
def test_lagged_rounds_decode_exactly_the_single_runs(
    N, idle, draft_first, fitted_pairs, monkeypatch
):
    # Each round queued before the previous acceptance is read (HF2Q_LAGGED_ROUNDS): the
    # rollback, the drafter's ragged context and the next blocks stay on the device; with
    # HF2Q_LAGGED_DRAFT_FIRST=1 (the default) each round's draft is queued before its verify is
    # built, and the verify every layer as it is built (the default, every 8, is more layers
    # than the fitted target has).
    monkeypatch.setenv("HF2Q_LAGGED_DRAFT_FIRST", draft_first)
    monkeypatch.setenv("HF2Q_FLUSH_LAYERS", draft_first)
    tok, target, drafter = _pair(*fitted_pairs["qwen35"])
    reqs, eos = _workload(tok, target)
    want = _expect("qwen35", tok, target, drafter, reqs, eos)
    summary, events = _check_batched(tok, target, drafter, reqs, eos, want, N, idle, lagged=True)
    rounds = [e for e in events if isinstance(e, SlotRound)]
    assert max(a for e in rounds for a in e.accepted) >= 7
    assert all(e.t_rollback == 0.0 for e in rounds)  # the lagged split: build and wait only
    assert sum(summary.accepted_histogram) == sum(len(e.slots) for e in rounds)


@pytest.mark.parametrize(("N", "depth"), [(3, "3"), (1, "4")])
def test_deeper_lagged_queues_decode_exactly_the_single_runs(N, depth, fitted_pairs, monkeypatch):
    # HF2Q_LAG_DEPTH: more rounds in flight before the oldest is read; the rows that finish
    # meanwhile compute rounds whose tokens are dropped, and nothing else changes.
    monkeypatch.setenv(select.LAG_DEPTH_ENV, depth)
    tok, target, drafter = _pair(*fitted_pairs["qwen35"])
    reqs, eos = _workload(tok, target)
    want = _expect("qwen35", tok, target, drafter, reqs, eos)
    _check_batched(tok, target, drafter, reqs, eos, want, N, "compact", lagged=True)


def test_lag_depth_switch_names_the_fix(monkeypatch):
    monkeypatch.delenv(select.LAG_DEPTH_ENV, raising=False)
    assert select.lag_depth() == 2
    monkeypatch.setenv(select.LAG_DEPTH_ENV, "3")
    assert select.lag_depth() == 3
    monkeypatch.setenv(select.LAG_DEPTH_ENV, "1")
    with pytest.raises(UsageError, match="HF2Q_LAG_DEPTH='1' must be 2, 3 or 4: fix or unset it"):
        select.lag_depth()


def test_lagged_rounds_with_a_random_drafter_and_short_blocks(qwen35_dir, tmp_path):
    import checkpoints as ck

    draft_dir = ck.build_drafter(tmp_path / "d", layers=2, seed=41)
    tok, target, drafter = _pair(qwen35_dir, draft_dir)
    reqs, eos = _workload(tok, target)
    reqs = [Request(r.prompt, max_tokens=min(r.max_tokens, 20)) for r in reqs[:6]]
    for block in (2, 5):
        want = _expect(("lagged", block), tok, target, drafter, reqs, eos, block_size=block)
        _check_batched(tok, target, drafter, reqs, eos, want, 4, block_size=block, lagged=True)


def test_idle_rows_kept_in_the_batch_change_no_tokens(fitted_pairs):
    tok, target, drafter = _pair(*fitted_pairs["qwen35"])
    reqs, eos = _workload(tok, target)
    want = _expect("qwen35", tok, target, drafter, reqs, eos)
    _, events = _check_batched(tok, target, drafter, reqs, eos, want, 4, idle="keep")
    rounds = [e for e in events if isinstance(e, SlotRound)]
    assert any(e.rows > len(e.slots) for e in rounds)  # idle rows really were computed


@pytest.mark.parametrize(
    ("name", "N", "block"), [("qwen35_dir", 3, 16), ("qwen35_moe_dir", 4, 5), ("qwen3_dir", 8, 9)]
)
def test_each_slot_decodes_exactly_its_single_run_with_random_drafter(
    name, N, block, request, tmp_path
):
    import checkpoints as ck

    draft_dir = ck.build_drafter(tmp_path / "d", layers=2, seed=30 + N)
    tok, target, drafter = _pair(request.getfixturevalue(name), draft_dir)
    reqs, eos = _workload(tok, target)
    reqs = [Request(r.prompt, max_tokens=min(r.max_tokens, 20)) for r in reqs[:6]]
    want = _expect((name, N), tok, target, drafter, reqs, eos, block_size=block)
    summary, _ = _check_batched(tok, target, drafter, reqs, eos, want, N, block_size=block)
    assert summary.acceptance_rate < 0.5  # mostly rejections: rollback really ran


@pytest.mark.parametrize(
    ("lagged", "draft_first", "ahead", "depth"),
    [
        (False, "0", False, "2"),
        (False, "0", True, "2"),
        (True, "0", False, "2"),
        (True, "1", False, "2"),
        (True, "1", False, "3"),
    ],
    ids=[
        "synchronous",
        "synchronous-drafts-ahead",
        "lagged",
        "lagged-draft-first",
        "lagged-three-in-flight",
    ],
)
def test_sampling_per_slot_equals_single_runs_with_the_same_seeds(
    fitted_pairs, lagged, draft_first, ahead, depth, monkeypatch
):
    # Drafts queued ahead are drawn with the key the next drafted round takes: with whole
    # blocks (size 2) each key goes to the same draw as in a single synchronous run.
    monkeypatch.setenv(select.LAG_DEPTH_ENV, depth)
    monkeypatch.setenv("HF2Q_LAGGED_DRAFT_FIRST", draft_first)
    monkeypatch.setenv("HF2Q_FLUSH_LAYERS", draft_first)
    tok, target, drafter = _pair(*fitted_pairs["qwen35"])
    reqs, eos = _workload(tok, target)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    reqs = [Request(r.prompt, max_tokens=r.max_tokens, seed=100 + i) for i, r in enumerate(reqs)]
    batched = run_slots(
        slots_dflash_generate(
            target,
            drafter,
            reqs,
            slots=3,
            sampling=sampling,
            block_size=2,
            eos_token_ids=eos,
            lagged=lagged,
            draft_ahead=ahead,
        )
    )
    plain = run_slots(
        slots_plain_generate(target, reqs, slots=3, sampling=sampling, eos_token_ids=eos)
    )
    for i, r in enumerate(reqs):
        one = SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i)
        single = run(
            dflash_generate(
                target,
                drafter,
                r.prompt,
                max_tokens=r.max_tokens,
                sampling=one,
                block_size=2,
                eos_token_ids=eos,
            )
        )
        assert batched.requests[i].tokens == single.tokens, f"request {i}"
        assert batched.requests[i].seed == 100 + i
        single_plain = run(
            plain_generate(
                target, r.prompt, max_tokens=r.max_tokens, sampling=one, eos_token_ids=eos
            )
        )
        assert plain.requests[i].tokens == single_plain.tokens, f"plain request {i}"
    greedy = _expect("qwen35", tok, target, drafter, _workload(tok, target)[0], eos)
    assert [s.tokens for s in batched.requests] != [g[0] for g in greedy]  # it did sample


def test_bad_slot_requests_are_refused_with_the_fix(fitted_pairs):
    tok, target, drafter = _pair(*fitted_pairs["qwen35"])
    with pytest.raises(UsageError, match="--slots must be at least 1"):
        slots_dflash_generate(target, drafter, [[1, 2]], slots=0)
    with pytest.raises(UsageError, match="empty prompt"):
        slots_plain_generate(target, [Request([], 4)], slots=2)
    with pytest.raises(UsageError, match="max_tokens must be at least 1"):
        slots_dflash_generate(target, drafter, [Request([1], 0)], slots=2)
    with pytest.raises(UsageError, match="block-size must be between 2"):
        slots_dflash_generate(target, drafter, [[1, 2]], slots=2, block_size=99)
    with pytest.raises(UsageError, match="idle must be one of"):
        slots_plain_generate(target, [[1, 2]], slots=2, idle="nap")
