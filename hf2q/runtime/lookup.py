"""Lookup drafts: propose the continuation of the sequence's own last n-gram as a round's draft.

What it does: :class:`NgramIndex` keeps, for every n-gram of 2..8 tokens of a sequence (prompt
and generated tokens), where its latest occurrence ended, updated in O(8) per token. Its
:meth:`~NgramIndex.propose` finds the longest suffix of the sequence that occurred before and
returns the tokens that followed it, extended periodically past the end of the sequence (a
repeating loop of period P < k is proposed in full). :class:`LookupChooser` decides per round
whether a DFlash round drafts with the drafter or with that proposal: by which of the two
accepted more recently in this sequence (an exponential average of accepted tokens per round,
each updated when its source is used), trying a lookup proposal first when it has no record.

Why: a block-diffusion drafter conditioned on the target's features can miss what a sequence
copies from itself (a repeated line, a loop the target has fallen into): the demo pair's
fibonacci prompt accepts nothing in most rounds with the drafter while its greedy continuation
repeats a 7-token loop. The target verifies a lookup proposal exactly like a drafted one, so
greedy output is unchanged (token-identical to plain greedy decoding); only the rounds differ.

With sampling (T > 0) a proposal is deterministic: its q puts all mass on each proposed token
(``hf2q.runtime.sampling.point_masses``), and rejection sampling keeps the target's distribution.

What it does not do: search anything but the sequence itself (no corpus, no other requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx

#: Shortest and longest suffix matched.
MIN_N, MAX_N = 2, 8
#: Tokens per round added to lookup's average for each round since it last drafted (so a source
#: that did badly once is tried again when the other keeps doing worse).
EXPLORE = 0.25


class NgramIndex:
    """The n-grams of a growing token sequence and where each last ended (see module doc)."""

    def __init__(self, tokens: Iterable[int] = (), min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = []
        # n-gram -> end (exclusive) of its latest occurrence that is not the current suffix
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the sequence."""
        seq, last = self.seq, self._last
        for t in tokens:
            end = len(seq)  # the n-grams ending here stop being the suffix once t follows
            for n in range(self.min_n, min(self.max_n, end) + 1):
                last[tuple(seq[end - n : end])] = end
            seq.append(int(t))

    def propose(self, k: int) -> tuple[list[int], int] | None:
        """The ``k`` tokens that followed the longest earlier occurrence of the sequence's
        suffix (repeated with the match's period where they run past the end), with that
        suffix's length; None when no suffix of ``min_n`` tokens recurs."""
        seq, L = self.seq, len(self.seq)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            start = self._last.get(tuple(seq[L - n :]))
            if start is None:
                continue
            period = L - start  # the match ended ``period`` tokens before the sequence does
            return [seq[start + (i % period)] for i in range(k)], n
        return None


class LookupChooser:
    """Per sequence: draft this round from the lookup proposal or from the drafter.

    Keeps an exponential average of tokens accepted per round for each source (updated with
    :meth:`record` when that source drafted). A proposal is used when lookup has not drafted
    yet in this sequence, or (once the drafter has drafted too) when lookup's average plus
    :data:`EXPLORE` per round since it last drafted is at least the drafter's: a drafter that
    stops accepting (a loop begins) soon gives lookup its turn again, a drafter far ahead keeps
    its rounds.
    """

    def __init__(self, tokens: Iterable[int], decay: float = 0.5) -> None:
        self.index = NgramIndex(tokens)
        self.decay = decay
        self.avg: dict[str, float | None] = {"lookup": None, "drafter": None}
        self.since_lookup = 0  # rounds since lookup last drafted
        self.lookup_rounds = 0  # rounds lookup drafted in this sequence

    def extend(self, tokens: Iterable[int]) -> None:
        self.index.extend(tokens)

    def round_done(self, source: str, accepted: int, committed: Iterable[int]) -> None:
        """After a round: ``source`` drafted it, ``accepted`` drafts were kept and ``committed``
        tokens joined the sequence (:meth:`record` and :meth:`extend`, and the count)."""
        self.record(source, accepted)
        self.extend(committed)
        self.lookup_rounds += source == "lookup"

    def proposal(self, k: int) -> list[int] | None:
        """The lookup draft of ``k`` tokens for this round, or None (draft with the drafter)."""
        lk, dr = self.avg["lookup"], self.avg["drafter"]
        if lk is not None and (dr is None or lk + EXPLORE * self.since_lookup < dr):
            return None  # the drafter's turn (to compare, or it is ahead): no search needed
        found = self.index.propose(k)
        return None if found is None else found[0]

    def record(self, source: str, accepted: int) -> None:
        """``source`` ("lookup" or "drafter") drafted a round that accepted ``accepted`` tokens."""
        self.since_lookup = 0 if source == "lookup" else self.since_lookup + 1
        old = self.avg[source]
        self.avg[source] = (
            float(accepted) if old is None else self.decay * old + (1 - self.decay) * accepted
        )


class RowsLookup:
    """The lookup proposals and choosers of several rows, computed on the device.

    What it does: holds every row's tokens (prompt and generated) and its chooser's state
    (:class:`LookupChooser`'s averages and ``since_lookup``) as arrays, and builds, as lazy MLX
    ops, each row's proposal (:meth:`NgramIndex.propose`: the longest recurring suffix of 2..8
    tokens, its latest earlier occurrence, the tokens after it repeated with its period), the
    choice between that proposal and the drafter's tokens (:meth:`LookupChooser.proposal`), and
    after the round the update of both (:meth:`LookupChooser.round_done`).

    Why: lagged rounds (``hf2q.runtime.slots``) queue round k+1 before round k's acceptance is
    read, so a host-side proposal, which needs the row's latest tokens, turns them synchronous
    whenever one is due, and with several rows one nearly always is. Built from arrays the
    proposal needs nothing from the host, so with lookup on the rounds stay lagged.

    The choice is the host chooser's, in float32 instead of Python's float64: the averages are
    halvings of small integers, exact in either until about 20 rounds without a reset, after
    which a near-tie could go the other way. Greedy tokens never depend on it (every proposal
    is verified); only which source drafts a round. What it does not do: sampling (T > 0),
    whose per-row keys are drawn in the synchronous order (the caller keeps host proposals).
    """

    def __init__(self, choosers: Sequence[LookupChooser | None], width: int, room: int) -> None:
        """``choosers`` per row (None: an idle row, never proposes); ``width``: tokens per
        proposal; ``room``: tokens any row may still gain (its capacity is its length plus
        this plus two blocks: rounds in flight after a row finishes append too)."""
        lens = [len(c.index.seq) if c is not None else 0 for c in choosers]
        cap = max(lens) + room + 2 * (width + 1) + 1
        hist = [(c.index.seq if c is not None else []) for c in choosers]
        self.hist = mx.array([h + [-1] * (cap - len(h)) for h in hist], dtype=mx.int32)
        self.length = mx.array(lens, dtype=mx.int32)  # an idle row's 0 never matches

        def avg(c: LookupChooser | None, src: str) -> float:
            v = c.avg[src] if c is not None else None
            return 0.0 if v is None else float(v)

        def has(c: LookupChooser | None, src: str) -> bool:
            return c is not None and c.avg[src] is not None

        self.avg_lookup = mx.array([avg(c, "lookup") for c in choosers], dtype=mx.float32)
        self.avg_drafter = mx.array([avg(c, "drafter") for c in choosers], dtype=mx.float32)
        self.has_lookup = mx.array([has(c, "lookup") for c in choosers])
        self.has_drafter = mx.array([has(c, "drafter") for c in choosers])
        self.since = mx.array(
            [c.since_lookup if c is not None else 0 for c in choosers], dtype=mx.float32
        )
        self.decay = next((c.decay for c in choosers if c is not None), 0.5)
        # What every round's search reads, built once: an earlier occurrence's end e, the
        # tokens j back from an end, the occurrence's positions e - 1 - j (last first).
        self._end = mx.arange(cap, dtype=mx.int32)[None, :]
        self._back = mx.arange(MAX_N, dtype=mx.int32)[None, :]
        at = self._end[:, :, None] - 1 - self._back[:, None, :]  # (1, cap, MAX_N)
        self._at = mx.maximum(at, 0).reshape(1, -1)
        self._inside = at >= 0
        self._ahead = mx.arange(width, dtype=mx.int32)[None, :]
        self._col = mx.arange(width + 1, dtype=mx.int32)[None, :]  # a round's drafts + bonus

    def propose(self) -> tuple[Any, Any]:
        """``(tokens (R, width) int32, use (R,) bool)``: each row's proposal (anything where it
        has none) and whether its chooser drafts this round from it."""
        hist, L = self.hist, self.length[:, None]
        cap = hist.shape[1]
        suffix = L - 1 - self._back  # (R, MAX_N): the sequence's last tokens, last first
        back = mx.take_along_axis(hist, mx.maximum(suffix, 0), axis=1)
        seen = mx.take_along_axis(hist, self._at, axis=1).reshape(-1, cap, MAX_N)
        same = (seen == back[:, None, :]) & self._inside & (suffix >= 0)[:, None, :]
        run = mx.cumprod(same.astype(mx.int32), axis=-1).sum(axis=-1)  # (R, cap)
        ok = (run >= MIN_N) & (self._end < L)
        score = mx.where(ok, run * cap + self._end, -1)  # longest suffix, then latest end
        start = mx.argmax(score, axis=1).astype(mx.int32)
        found = mx.max(score, axis=1) >= 0
        period = mx.maximum(self.length - start, 1)
        tokens = mx.take_along_axis(hist, start[:, None] + self._ahead % period[:, None], axis=1)
        lk, dr = self.avg_lookup, self.avg_drafter
        turn = ~self.has_lookup | (self.has_drafter & (lk + EXPLORE * self.since >= dr))
        return tokens, found & turn

    def update(self, draft: Any, accepted: Any, bonus: Any, use: Any) -> None:
        """After a round: each row's ``accepted`` (R,) drafts of ``draft`` (R, width) and its
        ``bonus`` (R,) token join its tokens; ``use`` (R,) says which source drafted it."""
        cap, col = self.hist.shape[1], self._col
        a = accepted.astype(mx.int32)
        b = bonus.astype(mx.int32)[:, None]
        vals = mx.where(col == a[:, None], b, mx.concatenate([draft.astype(mx.int32), b], axis=1))
        where = mx.minimum(self.length[:, None] + col, cap - 1)
        self.hist = mx.put_along_axis(self.hist, where, vals, axis=1)
        self.length = self.length + a + 1
        af = a.astype(mx.float32)
        keep, new = self.decay, 1 - self.decay

        def mean(avg: Any, has: Any) -> Any:
            return mx.where(has, keep * avg + new * af, af)

        self.avg_lookup = mx.where(use, mean(self.avg_lookup, self.has_lookup), self.avg_lookup)
        self.avg_drafter = mx.where(use, self.avg_drafter, mean(self.avg_drafter, self.has_drafter))
        self.has_lookup = self.has_lookup | use
        self.has_drafter = self.has_drafter | ~use
        self.since = mx.where(use, 0.0, self.since + 1)

    @property
    def state(self) -> list[Any]:
        """The arrays to evaluate with a round."""
        return [
            self.hist,
            self.length,
            self.avg_lookup,
            self.avg_drafter,
            self.has_lookup,
            self.has_drafter,
            self.since,
        ]
