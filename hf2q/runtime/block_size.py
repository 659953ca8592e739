"""Each DFlash round's block size from what rounds have cost and accepted (``--block-size auto``).

Why: a round commits ``1 + a`` tokens for the time of a draft and a verify of ``b`` tokens.
Where the verify's cost hardly grows with ``b`` (a GPU reads the weights once for all rows),
the drafter's whole block is best. Where it grows with the rows (MLX's CPU products cost about
linearly in them), a shorter block commits more tokens a second. The demo pair on this project's
2-core CPU, six prompts, medians: 68.6 tok/s at ``b = 16``, 99.1 at 4, 102.5 with this chooser,
plain decoding 84.0 (docs/BENCHMARKS.md, "Block sizes on a CPU").

What it does: :class:`BlockChooser` picks the size of the highest expected tokens a second,
``E(b) / t(b)``:

* ``t(b)``: each size's measured round time (an exponential average; the first round of a size
  left out, it traces that size's graphs), interpolated linearly for sizes not yet run;
* ``E(b)``: the tokens the size's own recent rounds committed, blended with a model that pools
  every round: per block position ``k``, how often a draft reached it and was accepted (decayed,
  so it follows the text), ``E = 1 + sum_k prod_{j <= k} p_j``, positions never reached taking the
  deepest estimate. The pooled model prices sizes barely run; a size's own rounds correct it
  (a drafter does not accept alike at every block size: on its default prompt without lookup,
  the demo drafter's first draft was accepted in 92% of the rounds in blocks of 4 and in 82% in
  blocks of 3).

The first rounds run the whole block and a quarter of it. :data:`GROW_AFTER` rounds in a row that
accept every draft try the next size up (a whole block accepted says nothing of how far a longer
one would have gone: on the demo's own prompt, whose continuation turns into a table the drafter
knows by heart, this finds the whole block's 15 accepted drafts a round). And every ``interval``
rounds one round explores: the whole block, the size above the best, the size below it, in turn.
The interval starts at :data:`EXPLORE_EVERY` and doubles (up to :data:`EXPLORE_MAX`) while
exploring does not change the choice, so a settled choice pays little for it.

Only the rounds differ: with T = 0 every round commits the target's greedy tokens whatever its
size, so the output is plain greedy decoding's. Sampled runs keep a fixed size (a size chosen from
timings would make a seeded run's draws depend on the machine's speed).
"""

from __future__ import annotations

from collections import Counter, deque

#: ``block_size`` value (and ``--block-size`` word) for sizes chosen round by round.
AUTO = "auto"
#: Rounds between exploring rounds at first, and at most (doubling while exploring changes nothing).
EXPLORE_EVERY = 8
EXPLORE_MAX = 64
#: Weight an observation (a position's acceptance, a size's tokens) keeps after each later round.
DECAY = 0.9
#: Rounds in a row accepting every draft after which the next size up is tried.
GROW_AFTER = 2
#: Weight of a new round's time in its size's average.
COST_WEIGHT = 0.25
#: The first draft's acceptance before it is observed, and the weight (in rounds) of each
#: position's prior: the estimate of the position before it.
PRIOR_P = 0.5
PRIOR_WEIGHT = 1.0
#: Weight (in rounds) of the pooled model's estimate against a size's own rounds.
MODEL_WEIGHT = 2.0
#: The block sizes considered (with the drafter's own), one graph shape each.
SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32)
#: A round's time counts at most this many times its size's average (a slow outlier, the host
#: busy elsewhere, moves the average less).
OUTLIER = 2.0


class BlockChooser:
    """The next round's block size for one sequence, from its earlier rounds.

    Call :meth:`next` for a round's size, then :meth:`record` with its outcome.
    """

    def __init__(self, max_block: int) -> None:
        if max_block < 2:
            raise ValueError(f"max_block must be at least 2, got {max_block}")
        self.max_block = max_block
        self.sizes = sorted({b for b in SIZES if b <= max_block} | {max_block})
        self.reached = [0.0] * max_block  # index k: decayed rounds whose draft k was checked
        self.kept = [0.0] * max_block  # index k: ... and accepted
        self.own: dict[int, list[float]] = {}  # size -> [decayed rounds, decayed tokens]
        self.cost: dict[int, float] = {}  # size -> average seconds a round (warm)
        self.rounds: Counter[int] = Counter()  # rounds run at each size
        quarter = max(b for b in self.sizes if b <= max(2, max_block // 4))
        self.plan = deque([max_block, max_block, quarter, quarter])
        self.interval = EXPLORE_EVERY
        self.since_explore = 0
        self.explores = 0  # exploring rounds so far (which kind is next)
        self.explored_from: int | None = None  # the best size when the last exploration ran
        self.full_streak = 0  # rounds in a row that accepted every draft

    def accept_probs(self, b: int) -> list[float]:
        """The pooled model's probabilities that drafts 1..b-1 are accepted, each after the
        ones before it: a position's counts shrunk toward the one before it (the first's toward
        :data:`PRIOR_P`), so positions short blocks never reach take the deepest one seen."""
        probs, prior = [], PRIOR_P
        for k in range(1, b):
            p = (self.kept[k] + PRIOR_WEIGHT * prior) / (self.reached[k] + PRIOR_WEIGHT)
            probs.append(p)
            prior = p
        return probs

    def model_tokens(self, b: int) -> float:
        """The pooled model's expected tokens a round of ``b`` commits (bonus + accepted)."""
        total, chain = 1.0, 1.0
        for p in self.accept_probs(b):
            chain *= p
            total += chain
        return total

    def expected_tokens(self, b: int) -> float:
        """Expected tokens a round of ``b`` commits: its own recent rounds' mean, blended with
        :meth:`model_tokens` (weight :data:`MODEL_WEIGHT` rounds)."""
        n, tokens = self.own.get(b, (0.0, 0.0))
        return (tokens + MODEL_WEIGHT * self.model_tokens(b)) / (n + MODEL_WEIGHT)

    def round_cost(self, b: int) -> float | None:
        """Seconds a round of ``b``: measured, else interpolated (or extrapolated) linearly
        between the nearest measured sizes; None while nothing is known."""
        if b in self.cost:
            return self.cost[b]
        known = sorted(self.cost.items())
        if not known:
            return None
        if len(known) == 1:
            return known[0][1]
        below = [p for p in known if p[0] < b]
        above = [p for p in known if p[0] > b]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
        elif below:
            (x0, y0), (x1, y1) = below[-2:]
        else:
            (x0, y0), (x1, y1) = above[:2]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return max(y0 + slope * (b - x0), min(c for _, c in known) * 0.5)

    def rate(self, b: int) -> float:
        """Expected tokens a second at ``b`` (0 while its cost is unknown)."""
        cost = self.round_cost(b)
        return 0.0 if cost is None or cost <= 0 else self.expected_tokens(b) / cost

    def best(self) -> int:
        """The size of the highest :meth:`rate` (the larger one on a tie)."""
        return max(self.sizes, key=lambda b: (self.rate(b), b))

    def next(self) -> int:
        """The next round's block size (before :meth:`record` of the last one is needed)."""
        if self.plan:
            return self.plan.popleft()
        best = self.best()
        if self.explored_from is not None:  # the round after an exploration: did it matter?
            changed = best != self.explored_from
            self.interval = EXPLORE_EVERY if changed else min(2 * self.interval, EXPLORE_MAX)
            self.explored_from = None
        self.since_explore += 1
        if self.full_streak >= GROW_AFTER and best < self.max_block:
            # Rounds that accept every draft say nothing of how far a longer block would have
            # gone: try the next size up (the same rounds' estimates then price it).
            self.full_streak = 0
            return self.sizes[self.sizes.index(best) + 1]
        if self.since_explore < self.interval:
            return best
        self.since_explore = 0
        i = self.sizes.index(best)
        kinds = [
            self.max_block,
            self.sizes[min(i + 1, len(self.sizes) - 1)],
            self.sizes[max(i - 1, 0)],
        ]
        size = kinds[self.explores % 3]
        self.explores += 1
        self.explored_from = best
        return size

    def record(self, b: int, accepted: int, seconds: float) -> None:
        """A round of ``b`` tokens took ``seconds`` and accepted ``accepted`` drafts (whoever
        drafted it: with lookup on, the rounds' mix of drafter and lookup proposals is what a
        size's tokens and time are)."""
        first = self.rounds[b] == 0  # a size's first round traces its graphs: not its cost
        self.rounds[b] += 1
        self.full_streak = self.full_streak + 1 if accepted == b - 1 else 0
        if not first:
            old = self.cost.get(b)
            if old is None:
                self.cost[b] = seconds
            else:
                self.cost[b] = old + COST_WEIGHT * (min(seconds, OUTLIER * old) - old)
        self.reached = [x * DECAY for x in self.reached]
        self.kept = [x * DECAY for x in self.kept]
        for k in range(1, min(accepted + 1, b - 1) + 1):
            self.reached[k] += 1.0
            self.kept[k] += k <= accepted
        for stats in self.own.values():
            stats[0] *= DECAY
            stats[1] *= DECAY
        stats = self.own.setdefault(b, [0.0, 0.0])
        stats[0] += 1.0
        stats[1] += 1.0 + accepted
