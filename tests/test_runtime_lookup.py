"""Lookup drafts (hf2q/runtime/lookup.py): the n-gram index, the per-sequence choice, and the
lossless contract with lookup on (greedy DFlash, single sequence and slots, equal to plain
greedy decoding) on the embedded demo pair, whose fibonacci prompt falls into a loop."""

from __future__ import annotations

import io
import json

import pytest

from hf2q.runtime.lookup import LookupChooser, NgramIndex, RowsLookup


def test_proposes_what_followed_the_longest_earlier_suffix():
    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 4, 7, 5, 2, 3, 4])
    # suffix [2, 3, 4] last occurred ending at index 8 (followed by 7, 5, ...)
    assert idx.propose(3) == ([7, 5, 2], 3)
    idx.extend([7])
    assert idx.propose(2) == ([5, 2], 4)  # [2, 3, 4, 7] now matches, 4 tokens long


def test_a_loop_is_proposed_in_full_past_the_end_of_the_sequence():
    loop = [11, 12, 13]
    idx = NgramIndex([5, *loop, *loop])
    proposal, n = idx.propose(7)
    assert proposal == [11, 12, 13, 11, 12, 13, 11] and n >= 2


def test_no_proposal_without_a_repeated_suffix_and_incremental_equals_whole():
    assert NgramIndex([1, 2, 3, 4, 5]).propose(4) is None
    assert NgramIndex([7]).propose(4) is None
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2]
    grown = NgramIndex(seq[:3])
    for t in seq[3:]:
        grown.extend([t])
        assert grown.propose(5) == NgramIndex(grown.seq).propose(5)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex([], min_n=3, max_n=2)


def test_chooser_tries_lookup_then_lets_the_drafter_compare():
    c = LookupChooser([1, 2, 3, 1, 2])
    assert c.proposal(2) == [3, 1]  # lookup untried: try it
    c.record("lookup", 0)
    assert c.proposal(2) is None  # the drafter has not drafted yet
    c.record("drafter", 3)
    assert c.proposal(2) is None  # drafter ahead (3 > 0)
    c.record("drafter", 0)
    assert c.proposal(2) is None  # 0 + 2 x EXPLORE < the drafter's 1.5
    for _ in range(3):
        c.record("drafter", 0)  # the drafter stops accepting: lookup's turn again
    assert c.proposal(2) == [3, 1]
    c.record("lookup", 5)
    assert c.avg["lookup"] == 2.5 and c.since_lookup == 0


def _random_rows(rng, rows, vocab):
    """Choosers over random sequences, some ending in a loop, one row idle (None) at times."""
    out = []
    for _ in range(rows):
        toks = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        if len(toks) > 5 and rng.random() < 0.5:
            period = rng.randint(1, 6)
            toks += [toks[-1 - i % period] for i in range(10)]
        out.append(LookupChooser(toks) if rng.random() < 0.9 else None)
    return out


def test_device_proposals_equal_the_host_index_and_chooser():
    """RowsLookup.propose (MLX ops) gives each row what LookupChooser.proposal gives: the same
    tokens where the host proposes, no use where it does not (no recurring suffix, the
    drafter's turn, an idle row)."""
    import random

    rng = random.Random(0)
    for trial in range(200):
        choosers = _random_rows(rng, rng.randint(1, 4), rng.choice([2, 3, 5, 50]))
        width = rng.randint(1, 15)
        tokens, use = RowsLookup(choosers, width, 20).propose()
        tokens, use = tokens.tolist(), use.tolist()
        for r, c in enumerate(choosers):
            want = c.proposal(width) if c is not None else None
            assert (tokens[r] if use[r] else None) == want, (trial, r)


def test_device_rounds_follow_the_host_choosers_round_by_round():
    """RowsLookup.update after each round (random drafts, accepted counts, bonus tokens, and
    the device's own choice of source) leaves the tokens, averages and choices that the host
    choosers' round_done gives, round after round."""
    import random

    import mlx.core as mx

    rng = random.Random(1)
    for trial in range(30):
        rows, width, vocab = rng.randint(1, 5), rng.randint(1, 15), rng.choice([3, 7, 100])
        choosers = [
            LookupChooser([rng.randrange(vocab) for _ in range(rng.randint(0, 20))])
            for _ in range(rows)
        ]
        rounds = rng.randint(1, 18)
        dev = RowsLookup(choosers, width, rounds * (width + 1))
        for k in range(rounds):
            proposed, use = dev.propose()
            drafted = [[rng.randrange(vocab) for _ in range(width)] for _ in range(rows)]
            draft = mx.where(use[:, None], proposed, mx.array(drafted, dtype=mx.int32))
            acc = [rng.randint(0, width) for _ in range(rows)]
            bonus = [rng.randrange(vocab) for _ in range(rows)]
            dev.update(draft, mx.array(acc), mx.array(bonus), use)
            mx.eval(dev.state)
            d, u = draft.tolist(), use.tolist()
            for r, c in enumerate(choosers):
                want = c.proposal(width)
                assert (d[r] if u[r] else None) == want, (trial, k, r)
                c.round_done("lookup" if u[r] else "drafter", acc[r], d[r][: acc[r]] + [bonus[r]])
        lengths = dev.length.tolist()
        for r, c in enumerate(choosers):
            assert dev.hist[r, : lengths[r]].tolist() == c.index.seq
            assert dev.avg_lookup[r].item() == (c.avg["lookup"] or 0.0)
            assert dev.avg_drafter[r].item() == (c.avg["drafter"] or 0.0)
            assert dev.since[r].item() == c.since_lookup


# -- the lossless contract with lookup on, on the demo pair -----------------------------------


@pytest.fixture(scope="module")
def demo():
    from hf2q.runtime.bench import BUILTIN_PROMPTS
    from hf2q.runtime.pair import encode_prompt, load_pair

    pair = load_pair(None, None)
    prompts = [encode_prompt(pair.tokenizer, p, chat=False) for p in BUILTIN_PROMPTS[:4]]
    return pair, prompts


@pytest.fixture(scope="module")
def plain64(demo):
    """Plain greedy decoding's 64 tokens for each of the demo prompts."""
    from hf2q.runtime.dflash import plain_generate, run

    pair, prompts = demo
    return [run(plain_generate(pair.target, p, max_tokens=64)).tokens for p in prompts]


def test_greedy_dflash_with_lookup_equals_plain_decoding(demo, plain64):
    from hf2q.runtime.dflash import dflash_generate, run
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    pair, prompts = demo
    t, d = pair.target, pair.drafter
    want, used = plain64, 0
    for i, (p, plain) in enumerate(zip(prompts, want)):
        for B in (16, 4) if i == 0 else (16,):  # (blocks of 4: the looping prompt)
            s = run(dflash_generate(t, d, p, max_tokens=64, block_size=B, lookup=True))
            assert s.tokens == plain, f"prompt {i} block {B}"
            assert s.lookup_rounds is not None
            used += s.lookup_rounds
    assert used > 0  # lookup drafted rounds (the fibonacci prompt loops)
    reqs = [Request(p, max_tokens=64) for p in prompts]
    batched = run_slots(slots_dflash_generate(t, d, reqs, slots=3, lookup=True))
    assert [r.tokens for r in batched.requests] == want
    assert sum(r.lookup_rounds for r in batched.requests) > 0


def test_lookup_cuts_the_rounds_of_the_looping_prompt(demo):
    """The fibonacci prompt's greedy continuation repeats a loop the drafter misses."""
    from hf2q.runtime.dflash import dflash_generate, run

    pair, prompts = demo
    off = run(dflash_generate(pair.target, pair.drafter, prompts[0], max_tokens=96))
    on = run(dflash_generate(pair.target, pair.drafter, prompts[0], max_tokens=96, lookup=True))
    assert on.tokens == off.tokens
    assert off.lookup_rounds is None and on.lookup_rounds > 0
    assert on.rounds < off.rounds / 2


def test_sampling_with_lookup_reproduces_per_seed_and_drafts_by_lookup(demo):
    """T > 0 with lookup: a seed gives the same tokens every run, and on the looping prompt
    lookup drafts rounds (its q is point masses: tests/test_runtime_sampling.py checks that the
    committed tokens then follow the target's distribution)."""
    from hf2q.runtime.dflash import dflash_generate, run
    from hf2q.runtime.sampling import SamplingParams
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    pair, prompts = demo
    sp = SamplingParams(temperature=0.3, seed=1)
    runs = [
        run(
            dflash_generate(
                pair.target, pair.drafter, prompts[0], max_tokens=48, sampling=sp, lookup=True
            )
        )
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].lookup_rounds > 0
    batched = run_slots(
        slots_dflash_generate(
            pair.target,
            pair.drafter,
            [Request(p, 48) for p in prompts[:2]],
            slots=2,
            sampling=sp,
            lookup=True,
        )
    )
    assert sum(r.lookup_rounds for r in batched.requests) > 0


@pytest.fixture
def drafter_calls(monkeypatch):
    """A list that grows by one at each drafter forward (the test's own counting wrapper)."""
    from hf2q.runtime.drafter import DFlashDraftModel

    calls = []
    forward = DFlashDraftModel.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDraftModel, "__call__", counted)
    return calls


def _drafter_forwards_bound(rounds, extra: int = 0) -> tuple[int, int]:
    """(lookup-only rounds, the most drafter forwards drafts queued ahead may take): one a
    round some row drafts with the drafter, plus one ahead of each run of lookup-only rounds
    and one ahead of the last round (a row that finishes with no request waiting leaves the
    others' drafts queued ahead), plus ``extra`` (requests that take a finished row's place)."""
    only = [all(src == "lookup" for src in e.sources) for e in rounds]
    runs = sum(o and (i == 0 or not only[i - 1]) for i, o in enumerate(only))
    return sum(only), len(rounds) - sum(only) + runs + 1 + extra


@pytest.mark.parametrize(("n", "ahead"), [(1, False), (2, False), (1, True), (2, True)])
def test_batched_rounds_drafted_only_by_lookup_skip_the_drafter(
    demo, plain64, n, ahead, drafter_calls
):
    # As the single-sequence loop does: no drafter forward when every busy row verifies its
    # lookup proposal; its context rows reach the drafter with the next round's (ragged join).
    # Drafting ahead (the default on CUDA) runs the drafter before the round that uses it, so
    # it also runs for a round that then verifies only lookup proposals, but never after one.
    from hf2q.runtime.slots import Request, SlotRound, SlotsSummary, slots_dflash_generate

    pair, prompts = demo
    reqs = [Request(p, max_tokens=64) for p in prompts[:n]]
    events = list(
        slots_dflash_generate(
            pair.target,
            pair.drafter,
            reqs,
            slots=n,
            lookup=True,
            lagged=False,
            draft_ahead=ahead,
        )
    )
    summary = events[-1]
    assert isinstance(summary, SlotsSummary)
    assert [r.tokens for r in summary.requests] == plain64[:n]
    rounds = [e for e in events if isinstance(e, SlotRound)]
    only, most = _drafter_forwards_bound(rounds)
    assert only > 0
    if not ahead:
        assert len(drafter_calls) == len(rounds) - only
    else:  # (no request waits here)
        assert len(drafter_calls) <= most
        # One sequence's lookup-only rounds come in a run (four at the end with the demo pair),
        # so the skip saves drafter forwards even with drafts ahead; at two slots they are
        # isolated rounds, each costing the draft queued ahead of it, and nothing is saved.
        if n == 1:
            assert most < len(rounds)


def test_lagged_rounds_with_lookup_keep_plain_greedy_tokens(demo, plain64):
    # HF2Q_LAGGED_LOOKUP: rounds are lagged while the drafter drafts and synchronous while a
    # lookup proposal is due (it needs the latest tokens); greedy tokens stay plain decoding's.
    from hf2q.runtime.dflash import RoundDone, Summary, dflash_generate
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    pair, prompts = demo
    t, d = pair.target, pair.drafter
    want, kinds = plain64, set()
    for i, (p, plain) in enumerate(zip(prompts, want)):
        for B in (16, 4) if i == 0 else (16,):  # (blocks of 4: the looping prompt)
            events = list(
                dflash_generate(t, d, p, max_tokens=64, block_size=B, lookup=True, lagged=True)
            )
            s = events[-1]
            assert isinstance(s, Summary) and s.tokens == plain, f"prompt {i} block {B}"
            rounds = [e for e in events if isinstance(e, RoundDone)]
            assert s.lookup_rounds == sum(r.source == "lookup" for r in rounds)
            # A lagged round has no rollback share (its split is build / wait).
            kinds |= {(r.source, r.t_rollback == 0.0) for r in rounds}
    # Lagged drafter rounds, and synchronous lookup rounds in between.
    assert ("drafter", True) in kinds and ("lookup", False) in kinds
    assert ("lookup", True) not in kinds
    reqs = [Request(p, max_tokens=64) for p in prompts]
    batched = run_slots(slots_dflash_generate(t, d, reqs, slots=3, lookup=True, lagged=True))
    assert [r.tokens for r in batched.requests] == want
    assert sum(r.lookup_rounds for r in batched.requests) > 0


def test_sampled_lagged_rounds_with_lookup_reproduce_per_seed(demo):
    from hf2q.runtime.dflash import dflash_generate, run
    from hf2q.runtime.sampling import SamplingParams

    pair, prompts = demo
    sp = SamplingParams(temperature=0.3, seed=1)
    runs = [
        run(
            dflash_generate(
                pair.target,
                pair.drafter,
                prompts[0],
                max_tokens=48,
                sampling=sp,
                lookup=True,
                lagged=True,
            )
        )
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 48
    assert runs[0].lookup_rounds > 0


def test_generate_cli_reports_lookup_rounds_and_can_turn_it_off(capsys, monkeypatch):
    from hf2q.cli.app import main

    for flag, expect_none in (("--lookup", False), ("--no-lookup", True)):
        monkeypatch.setattr("sys.stdin", io.StringIO(""))  # nothing piped in: the demo prompt
        assert main(["generate", "-n", "24", flag, "--json"]) == 0
        rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (rec["lookup_rounds"] is None) == expect_none


def _queued_run(demo, plain64, slots, B, **options):
    """Four requests of different lengths (more than the slots: rows finish apart and take the
    next request) through the batched DFlash loop with ``options``; every request's tokens
    must be plain greedy decoding's. Returns the summary and the rounds."""
    from hf2q.runtime.slots import Request, SlotRound, SlotsSummary, slots_dflash_generate

    pair, prompts = demo
    lengths = [64, 41, 64, 23]
    reqs = [Request(p, max_tokens=m) for p, m in zip(prompts, lengths)]
    gen = slots_dflash_generate(
        pair.target, pair.drafter, reqs, slots=slots, block_size=B, **options
    )
    events = list(gen)
    summary = events[-1]
    assert isinstance(summary, SlotsSummary)
    want = [plain[:m] for plain, m in zip(plain64, lengths)]
    assert [r.tokens for r in summary.requests] == want, f"{slots} slots, block {B}, {options}"
    return summary, [e for e in events if isinstance(e, SlotRound)]


@pytest.mark.parametrize("slots", [1, 3])
def test_lagged_rounds_with_lookup_on_the_device_keep_plain_greedy_tokens(demo, plain64, slots):
    # HF2Q_LAGGED_LOOKUP=device: batched greedy rounds take the rows' proposals from the device
    # and stay lagged while proposals are due; every request (different lengths, more
    # requests than slots, so rows finish apart and take the next request) keeps plain greedy
    # decoding's tokens, lookup drafts rounds, and no round is synchronous. Blocks of 4 at three
    # slots only (one slot's many short rounds cost the most and add no other path).
    for B in (16, 4) if slots == 3 else (16,):
        on = {"lookup": True, "lagged": True, "device_lookup": True}
        summary, rounds = _queued_run(demo, plain64, slots, B, **on)
        by_lookup = sum(src == "lookup" for e in rounds for src in e.sources)
        assert by_lookup > 0 and sum(r.lookup_rounds for r in summary.requests) == by_lookup
        assert all(e.t_rollback == 0.0 for e in rounds)  # lagged: build / wait, no rollback


@pytest.mark.parametrize("slots", [1, 3])
def test_drafts_queued_ahead_keep_plain_greedy_tokens(demo, plain64, slots, drafter_calls):
    # HF2Q_DRAFT_AHEAD: a synchronous round queues the next round's drafter from its own
    # results on the device before reading them; the next round verifies those drafts (or a
    # row's lookup proposal). Every request (different lengths, a queue, so rows finish apart
    # and rows change) keeps plain greedy decoding's tokens, with lookup and drafter rounds;
    # and the drafts are as good as drafting after the read (a drafter given the wrong
    # context accepts a third as much and needs more rounds). The drafter's forwards stay
    # within :func:`_drafter_forwards_bound`, one more for each request that takes a
    # finished row's place.
    row_rounds = {}
    for ahead, B in [(True, 4)] if slots == 1 else [(True, 16), (False, 16)]:
        on = {"lookup": True, "lagged": False, "draft_ahead": ahead}
        drafter_calls.clear()
        _, rounds = _queued_run(demo, plain64, slots, B, **on)
        assert {src for e in rounds for src in e.sources} == {"lookup", "drafter"}
        row_rounds[ahead, B] = sum(len(e.slots) for e in rounds)
        if ahead:  # _queued_run's four requests: 4 - slots take a finished row's place
            assert len(drafter_calls) <= _drafter_forwards_bound(rounds, 4 - slots)[1]
    if slots == 3:
        # A drafter given the wrong context needs far more rounds. Queued ahead, the drafter
        # may run over other rows than after the read, and on CUDA its products of many rows
        # (cuBLAS) need not give a row the same bits at another row count, so a near-tie draft
        # can differ: the H200 gave 67 row-rounds against 66 (session 37). Tokens stay exact.
        assert row_rounds[True, 16] <= row_rounds[False, 16] * 1.05 + 1


def test_sampled_drafts_queued_ahead_draw_what_drafting_after_the_read_draws(demo):
    # T > 0: a draft queued ahead is drawn with the key the row's next drafted round takes,
    # and a row that picks its lookup proposal takes no key, as when drafting after the read.
    # With whole blocks (size 2) every key goes to the same draw: the same tokens, with a
    # queue, rows finishing apart, and rounds drafted by lookup and by the drafter.
    from hf2q.runtime.sampling import SamplingParams
    from hf2q.runtime.slots import Request, SlotRound, slots_dflash_generate

    pair, prompts = demo
    sp = SamplingParams(temperature=0.7, seed=5)
    out = {}
    for ahead in (False, True):
        reqs = [Request(p, max_tokens=m) for p, m in zip(prompts, [40, 29, 40, 17])]
        events = list(
            slots_dflash_generate(
                pair.target,
                pair.drafter,
                reqs,
                slots=3,
                block_size=2,
                sampling=sp,
                lookup=True,
                lagged=False,
                draft_ahead=ahead,
            )
        )
        rounds = [e for e in events if isinstance(e, SlotRound)]
        assert {src for e in rounds for src in e.sources} == {"lookup", "drafter"}
        out[ahead] = [r.tokens for r in events[-1].requests]
    assert out[True] == out[False]
