"""``--block-size auto``: the chooser finds the fastest block size from what rounds cost and
accept, and the CLI runs it (greedy tokens unchanged: test_runtime_fidelity covers "auto").

The chooser is driven by a model of a machine and a drafter: a round of ``b`` tokens costs
``fixed + per_row * b`` seconds, and the drafter's run of accepted drafts at the full block is
drawn from a fixed distribution (a round of ``b`` accepts ``min(run, b - 1)``). Against it, every
fixed size's long-run tokens a second is known exactly, so the test can say how close the
chooser comes to the best one.
"""

from __future__ import annotations

import random

import pytest
from conftest import generate_json, run_generate

from hf2q.runtime.block_size import EXPLORE_EVERY, BlockChooser


def _expected_rate(b: int, runs: list[int], fixed: float, per_row: float) -> float:
    """Tokens a second of a fixed size ``b`` against the model (exact, from its runs)."""
    tokens = sum(1 + min(r, b - 1) for r in runs) / len(runs)
    return tokens / (fixed + per_row * b)


def _drive(chooser: BlockChooser, runs: list[int], fixed: float, per_row: float, rounds: int):
    """Run ``rounds`` rounds of the model through the chooser; return (tokens, seconds, sizes)."""
    rng = random.Random(5)
    tokens = seconds = 0.0
    sizes = []
    for _ in range(rounds):
        b = chooser.next()
        a = min(rng.choice(runs), b - 1)
        t = fixed + per_row * b
        chooser.record(b, a, t)
        tokens += 1 + a
        seconds += t
        sizes.append(b)
    return tokens, seconds, sizes


# Runs of accepted drafts at the full block: a drafter that often fails early and sometimes
# accepts a long stretch (as the demo pair does).
MIXED = [0] * 3 + [1] * 2 + [2] * 4 + [3] * 3 + [5] * 2 + [8] + [15] * 2


@pytest.mark.parametrize(
    ("runs", "fixed", "per_row", "case"),
    [
        (MIXED, 0.015, 0.005, "CPU-like: each verify row costs a third of the fixed part"),
        (MIXED, 0.006, 0.00002, "GPU-like: the rows are almost free"),
        ([15] * 10, 0.015, 0.005, "a drafter that always accepts the whole block"),
        ([0] * 9 + [1], 0.015, 0.005, "a drafter that almost never agrees"),
    ],
)
def test_chooser_comes_close_to_the_best_fixed_size(runs, fixed, per_row, case):
    chooser = BlockChooser(16)
    tokens, seconds, sizes = _drive(chooser, runs, fixed, per_row, 400)
    rates = {b: _expected_rate(b, runs, fixed, per_row) for b in range(2, 17)}
    best = max(rates, key=rates.get)
    # Within 10% of the best fixed size over the whole run (exploration included), and far
    # ahead of the worst.
    assert tokens / seconds >= 0.9 * rates[best], (case, tokens / seconds, best, rates[best])
    assert tokens / seconds > 1.1 * min(rates.values()), case
    # After the first rounds it settles on (or next to) the best size.
    late = sizes[200:]
    settled = max(set(late), key=late.count)
    assert rates[settled] >= 0.95 * rates[best], (case, settled, best, rates)


def test_sizes_follow_the_costs():
    # The same drafter: with almost free rows the whole block wins; with costly rows a short
    # block does.
    flat = _drive(BlockChooser(16), MIXED, 0.006, 0.00002, 300)[2][150:]
    steep = _drive(BlockChooser(16), MIXED, 0.015, 0.005, 300)[2][150:]
    assert max(set(flat), key=flat.count) == 16
    assert max(set(steep), key=steep.count) <= 6


def test_first_rounds_try_the_whole_block_and_a_quarter_then_explore_less_and_less():
    chooser = BlockChooser(16)
    first = []
    for _ in range(4):
        first.append(chooser.next())
        chooser.record(first[-1], 0, 0.01 + 0.005 * first[-1])
    assert first == [16, 16, 4, 4]
    later = []
    for _ in range(EXPLORE_EVERY * 7):
        later.append(chooser.next())
        chooser.record(later[-1], 0, 0.01 + 0.005 * later[-1])
    # Nothing is accepted, so the shortest block wins. Exploring rounds try the whole block,
    # then the size above the best; each changed nothing, so the next comes twice as late.
    explored = [(i, b) for i, b in enumerate(later) if b != 2]
    assert [b for _, b in explored] == [16, 3], later
    (i0, _), (i1, _) = explored
    assert i0 == EXPLORE_EVERY - 1 and i1 - i0 == 2 * EXPLORE_EVERY
    assert later.count(2) == len(later) - 2


def test_a_sizes_first_round_is_not_its_cost_and_outliers_are_capped():
    chooser = BlockChooser(8)
    chooser.record(8, 3, 5.0)  # the first round traces its graphs: not counted
    assert chooser.round_cost(8) is None
    chooser.record(8, 3, 0.05)
    assert chooser.round_cost(8) == pytest.approx(0.05)
    chooser.record(8, 3, 10.0)  # a stall counts as at most twice the average
    assert chooser.round_cost(8) == pytest.approx(0.05 + 0.25 * (0.10 - 0.05))


def test_unmeasured_sizes_are_interpolated_between_measured_ones():
    chooser = BlockChooser(16)
    for b, t in ((4, 0.03), (4, 0.03), (16, 0.09), (16, 0.09)):
        chooser.record(b, 1, t)
    assert chooser.round_cost(10) == pytest.approx(0.06)
    assert chooser.round_cost(2) == pytest.approx(0.02)  # extrapolated along the same line
    assert chooser.round_cost(4) == pytest.approx(0.03)


def test_deeper_positions_inherit_the_deepest_estimate_seen():
    chooser = BlockChooser(16)
    for _ in range(20):
        chooser.record(4, 3, 0.03)  # every draft of a 4-token block accepted
    probs = chooser.accept_probs(16)
    assert probs[0] > 0.9 and probs[2] > 0.9
    # Positions 4..15 were never reached: they take position 3's estimate, not a fixed prior.
    assert all(abs(p - probs[2]) < 1e-9 for p in probs[3:])
    assert chooser.expected_tokens(16) > chooser.expected_tokens(4) > 3.5


def test_a_two_token_drafter_always_gets_two():
    chooser = BlockChooser(2)
    assert {chooser.next() for _ in range(30)} == {2}
    with pytest.raises(ValueError):
        BlockChooser(1)


# ---- the CLI -------------------------------------------------------------------------------------
PROMPT = "def add(a, b):"


def test_generate_block_size_auto_reports_its_sizes(capsys, qwen35_dir, drafter_dir):
    base = [PROMPT, "-m", str(qwen35_dir), "--no-chat", "-n", "40"]
    rec = generate_json(capsys, *base, "-d", str(drafter_dir), "-b", "auto")
    sizes = {int(b): n for b, n in rec["block_sizes"].items()}
    assert sum(sizes.values()) == rec["rounds"] and max(sizes) <= rec["block_size"] == 16
    assert sum(rec["accepted_histogram"]) == rec["rounds"]
    assert generate_json(capsys, *base, "--no-dflash")["tokens"] == rec["tokens"]
    # The plain-text summary names the sizes the rounds ran.
    code, _, err = run_generate(capsys, *base, "-d", str(drafter_dir), "-b", "auto")
    line = next(x for x in err.splitlines() if x.startswith("block size: "))
    assert code == 0 and line.startswith("block size: auto (rounds: ") and "16 x " in line


def test_generate_defaults_to_auto_on_a_cpu_when_greedy(capsys, qwen35_dir, drafter_dir):
    from hf2q.kernels import select

    base = [PROMPT, "-m", str(qwen35_dir), "-d", str(drafter_dir), "--no-chat", "-n", "24"]
    # On a GPU the drafter's size (a verify's rows cost little there).
    assert bool(generate_json(capsys, *base)["block_sizes"]) == (select.backend() == "cpu")
    assert generate_json(capsys, *base, "-b", "8")["block_sizes"] is None
    # Sampled: the drafter's size (a size chosen from timings would move a seeded run's draws).
    assert generate_json(capsys, *base, "--temp", "0.7", "--seed", "3")["block_sizes"] is None


@pytest.mark.parametrize("value", ["x", "1", "0", "-3", "2.5"])
def test_bad_block_size_is_one_line_naming_the_fix(capsys, value):
    code, _, err = run_generate(capsys, "-b", value, PROMPT)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "--block-size must be auto or a whole number from 2" in lines[0]
    assert repr(value) in lines[0]


def test_auto_with_sampling_says_it_keeps_the_drafters_size(capsys, qwen35_dir, drafter_dir):
    code, _, err = run_generate(
        capsys,
        PROMPT,
        "-m",
        str(qwen35_dir),
        "-d",
        str(drafter_dir),
        "--no-chat",
        "-n",
        "6",
        "-b",
        "auto",
        "--temp",
        "0.5",
        "--seed",
        "1",
    )
    assert code == 0, err
    assert "--block-size auto applies to greedy decoding" in err
