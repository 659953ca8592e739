"""Greedy DFlash is lossless: its tokens equal plain greedy decoding and mlx-lm's own generation.

On transformers-written tiny targets (hybrid Qwen3.5 conditional, 8-layer text-only, MoE, plain
Qwen3), float32, with drafters fitted to agree with each target (so long acceptances and
full-block accepts happen) and random ones (so rejections happen), for block sizes 2..16, with
EOS and max_tokens landing in the middle of a block, and with each round's size chosen by
``block_size="auto"``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from conftest import FIT_NEW_TOKENS, FIT_TEXTS, load_fitted

from hf2q.loading import load_model
from hf2q.runtime.dflash import RoundDone, Summary, dflash_generate, plain_generate, run
from hf2q.runtime.drafter import load_drafter
from hf2q.runtime.target import TargetModel

#: Block sizes per fitted pair; together they cover 2..16.
FITTED_BLOCKS = {
    "qwen35": (2, 3, 4, 6, 8, 10, 12, 14, 16, "auto"),
    "qwen35_causal": (2, 5, 7, 9, 11, 13, 15, 16, "auto"),
}
_cache: dict[Path, tuple] = {}


def _load(target_dir: Path, draft_dir: Path):
    key = (target_dir, draft_dir)
    if key not in _cache:
        _cache[key] = load_fitted(target_dir, draft_dir)
    return _cache[key]


def mlx_lm_greedy(lm, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy generation: every token stream_generate reports (a stopping EOS too)."""
    from mlx_lm.generate import stream_generate

    return [
        r.token
        for r in stream_generate(
            lm.model,
            lm.tokenizer,
            mx.array(prompt),
            max_tokens=max_tokens,
            sampler=lambda x: mx.argmax(x, axis=-1),
        )
    ]


def _dflash(target, drafter, prompt, **kw) -> tuple[Summary, list[RoundDone]]:
    events = list(dflash_generate(target, drafter, prompt, **kw))
    return events[-1], [e for e in events if isinstance(e, RoundDone)]


def _check_greedy(lm, target, drafter, prompts, block_sizes, n_max) -> list[RoundDone]:
    eos = lm.tokenizer.eos_token_ids
    all_rounds: list[RoundDone] = []
    for i, prompt in enumerate(prompts):
        n = n_max - 3 * i  # varied lengths so max_tokens lands anywhere in a block
        want = mlx_lm_greedy(lm, prompt, n)
        plain = run(plain_generate(target, prompt, max_tokens=n, eos_token_ids=eos))
        assert plain.tokens == want
        for B in block_sizes:
            summary, rs = _dflash(
                target, drafter, prompt, max_tokens=n, block_size=B, eos_token_ids=eos
            )
            assert summary.tokens == want, f"prompt {i} block {B}"
            assert summary.finish_reason == plain.finish_reason
            # Committed tokens are exactly the drafts accepted plus the bonus, in order.
            assert [t for r in rs for t in r.committed] == want[1:]
            if B == "auto" and len(rs) >= 3:  # the sizes really changed within the generation
                assert len({r.block_size for r in rs}) >= 2, [r.block_size for r in rs]
                assert summary.block_sizes is not None
                assert sum(summary.block_sizes.values()) == len(rs)
            all_rounds += rs
    return all_rounds


@pytest.mark.parametrize("name", ["qwen35", "qwen35_causal"])
def test_greedy_dflash_with_agreeing_drafter_equals_plain_and_mlx_lm(name, fitted_pairs):
    target_dir, draft_dir = fitted_pairs[name]
    lm, target, drafter = _load(target_dir, draft_dir)
    prompts = [lm.tokenizer.encode(t)[:4] for t in FIT_TEXTS[:4]]
    rs = _check_greedy(lm, target, drafter, prompts, FITTED_BLOCKS[name], FIT_NEW_TOKENS)
    # The fitted drafter really agreed with the target: not only rejections were exercised.
    full_blocks = sum(r.accepted == r.drafted and r.drafted >= 3 for r in rs)
    long_accepts = sum(r.accepted >= 7 for r in rs)
    assert full_blocks >= 5 and long_accepts >= 5, (full_blocks, long_accepts, len(rs))


@pytest.mark.parametrize(
    ("name", "layers"), [("qwen35_moe_dir", 2), ("qwen3_dir", 1), ("qwen35_dir", 3)]
)
def test_greedy_dflash_with_random_drafter_equals_plain_and_mlx_lm(name, layers, request, tmp_path):
    import checkpoints as ck

    draft_dir = ck.build_drafter(tmp_path / "d", layers=layers, seed=20 + layers)
    lm, target, drafter = _load(request.getfixturevalue(name), draft_dir)
    prompts = [lm.tokenizer.encode(t) for t in FIT_TEXTS[:2]]
    _check_greedy(lm, target, drafter, prompts, (2, 9, 16, "auto"), 24)


@pytest.mark.parametrize("name", ["qwen35", "qwen35_causal"])
def test_eos_inside_an_accepted_block_stops_exactly_there(name, fitted_pairs):
    target_dir, draft_dir = fitted_pairs[name]
    lm, target, drafter = _load(target_dir, draft_dir)
    truncated = 0
    for text in FIT_TEXTS[:2]:
        prompt = lm.tokenizer.encode(text)[:4]
        free = run(plain_generate(target, prompt, max_tokens=40))
        # Declare a token of the greedy continuation an EOS: generation must stop right after
        # its first occurrence, wherever it falls inside a round.
        for pos in (7, 13, 22):
            stop = free.tokens[pos]
            want = free.tokens[: free.tokens.index(stop) + 1]
            plain = run(plain_generate(target, prompt, max_tokens=40, eos_token_ids=[stop]))
            assert plain.tokens == want and plain.finish_reason == "stop"
            for B in (6, 16, "auto"):
                summary, rs = _dflash(
                    target, drafter, prompt, max_tokens=40, block_size=B, eos_token_ids=[stop]
                )
                assert summary.tokens == want and summary.finish_reason == "stop"
                last = rs[-1] if rs else None
                if last is not None and len(last.committed) < last.accepted + 1:
                    truncated += 1
    assert truncated >= 3  # the EOS really landed before the end of a round's accepted run


@pytest.mark.parametrize("name", ["qwen35", "qwen35_causal"])
def test_lagged_rounds_equal_plain_and_mlx_lm(name, fitted_pairs):
    # Each round queued before the last acceptance is read (HF2Q_LAGGED_ROUNDS), told as a
    # single run's events: same tokens, stops, counts.
    lm, target, drafter = _load(*fitted_pairs[name])
    eos = lm.tokenizer.eos_token_ids
    for i, text in enumerate(FIT_TEXTS[:3]):
        prompt = lm.tokenizer.encode(text)[:4]
        n = FIT_NEW_TOKENS - 3 * i
        want = mlx_lm_greedy(lm, prompt, n)
        stop = want[len(want) // 2]  # and a token of the continuation declared an EOS
        cut = want[: want.index(stop) + 1]
        for B, eos_ids, expect in [(3, eos, want), (16, eos, want), (8, [stop], cut)]:
            summary, rs = _dflash(
                target,
                drafter,
                prompt,
                max_tokens=n,
                block_size=B,
                eos_token_ids=eos_ids,
                lagged=True,
            )
            assert summary.tokens == expect, f"{name} prompt {i} block {B}"
            assert [t for r in rs for t in r.committed] == expect[1:]
            assert summary.rounds == len(rs) and rs[-1].generated == len(expect)
            assert rs[-1].finish_reason == summary.finish_reason
            assert summary.drafted == sum(r.drafted for r in rs)
            assert summary.accepted == sum(r.accepted for r in rs)
            assert all(r.bonus == r.committed[-1] for r in rs if len(r.committed) == r.accepted + 1)


def test_max_tokens_inside_a_block_truncates_and_counts_exactly(fitted_pairs):
    target_dir, draft_dir = fitted_pairs["qwen35"]
    lm, target, drafter = _load(target_dir, draft_dir)
    prompt = lm.tokenizer.encode(FIT_TEXTS[0])[:4]
    full = run(plain_generate(target, prompt, max_tokens=40)).tokens
    for n in (1, 2, 3, 9, 17, 31):
        summary, rs = _dflash(target, drafter, prompt, max_tokens=n, block_size=16)
        assert summary.tokens == full[:n]
        assert summary.generation_tokens == n and summary.finish_reason == "length"
        assert all(r.drafted <= 15 for r in rs)


def test_summary_metrics_follow_dflash_definitions(fitted_pairs):
    target_dir, draft_dir = fitted_pairs["qwen35"]
    lm, target, drafter = _load(target_dir, draft_dir)
    prompt = lm.tokenizer.encode(FIT_TEXTS[1])[:4]
    summary, rs = _dflash(target, drafter, prompt, max_tokens=40, block_size=8)
    a = [r.accepted for r in rs]
    assert summary.rounds == len(rs)
    assert summary.tau == pytest.approx(sum(x + 1 for x in a) / len(a))
    assert summary.acceptance_rate == pytest.approx(sum(a) / sum(r.drafted for r in rs))
    assert summary.draft_share == pytest.approx(sum(a) / sum(x + 1 for x in a))
    assert summary.accepted_histogram == [a.count(k) for k in range(8)]
    assert all(r.rolled_back == r.drafted - r.accepted for r in rs)
    assert summary.generation_tps > 0 and summary.prompt_tps > 0


def test_measure_acceptance_pools_rounds_over_prompts(fitted_pairs):
    from hf2q.runtime.dflash import measure_acceptance

    target_dir, draft_dir = fitted_pairs["qwen35"]
    lm, target, drafter = _load(target_dir, draft_dir)
    prompts = [lm.tokenizer.encode(t)[:4] for t in FIT_TEXTS[:2]]
    stats = measure_acceptance(target, drafter, prompts, max_tokens=30, block_size=8)
    per = [_dflash(target, drafter, p, max_tokens=30, block_size=8)[1] for p in prompts]
    a = [r.accepted for rs in per for r in rs]
    assert stats.rounds == len(a) and sum(stats.accepted_histogram) == len(a)
    assert stats.tau == pytest.approx(sum(x + 1 for x in a) / len(a))
    assert stats.acceptance_rate == pytest.approx(sum(a) / sum(r.drafted for rs in per for r in rs))
    assert stats.tokens == 60


def test_chunked_prefill_gives_the_same_tokens(fitted_pairs):
    target_dir, draft_dir = fitted_pairs["qwen35"]
    lm, target, drafter = _load(target_dir, draft_dir)
    prompt = lm.tokenizer.encode("def add(a, b):\n    return a + b\nclass Counter:")
    want = mlx_lm_greedy(lm, prompt, 20)
    for step in (3, 7):  # several chunks, each one's features appended to the drafter cache
        summary, _ = _dflash(
            target,
            drafter,
            prompt,
            max_tokens=20,
            prefill_step_size=step,
            eos_token_ids=lm.tokenizer.eos_token_ids,
        )
        assert summary.tokens == want
        plain = run(
            plain_generate(
                target,
                prompt,
                max_tokens=20,
                prefill_step_size=step,
                eos_token_ids=lm.tokenizer.eos_token_ids,
            )
        )
        assert plain.tokens == want


def test_quantized_target_is_lossless_too(qwen35_dir, drafter_dir):
    import mlx.nn as nn

    lm = load_model(qwen35_dir)
    nn.quantize(lm.model, group_size=32, bits=8)
    target = TargetModel(lm.model, lm.tokenizer)
    drafter = load_drafter(drafter_dir).bind(target.embed, target.head)
    prompt = lm.tokenizer.encode(FIT_TEXTS[0])
    want = mlx_lm_greedy(lm, prompt, 16)
    for B in (4, 16):
        summary, _ = _dflash(
            target,
            drafter,
            prompt,
            max_tokens=16,
            block_size=B,
            eos_token_ids=lm.tokenizer.eos_token_ids,
        )
        assert summary.tokens == want
