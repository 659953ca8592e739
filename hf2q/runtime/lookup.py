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

from collections.abc import Iterable

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
