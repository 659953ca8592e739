"""The drafter's forward of a full block as one compiled graph (``HF2Q_COMPILE_DRAFT=1``) drafts
what the layer path drafts and leaves the drafter's caches as the layer path leaves them.

Off CUDA the graph attends with MLX's attention over the whole buffer, each row's positions past
its block masked out (``tests/test_kernels_row_attention.py`` checks it with the row-invariant
kernel, emulated, against the fast layers). These tests run it in float32 against the layer
calls: logits and the kept context of every layer after rounds keeping different numbers of
context rows (up to several blocks, as after lookup rounds), for one sequence and for ragged
slot rows (counts on the host, and only on the device as lagged rounds keep them); one trace
whatever a round kept; new weights traced again; then greedy DFlash through it against plain
greedy decoding, one sequence and batched.
"""

from __future__ import annotations

import checkpoints as ck
import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import FIT_TEXTS, assert_fitted_batched_equals_plain, load_fitted
from mlx_lm.models.cache import KVCache, RotatingKVCache

from hf2q.kernels import select
from hf2q.runtime import draft_graph
from hf2q.runtime.draft_graph import CompiledDraft
from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel
from hf2q.runtime.slot_cache import SlotKVCache, make_slot_draft_cache

B = 8  # block length of the unit tests


@pytest.fixture
def graph_on(monkeypatch):
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "1")


def _drafter(**overrides) -> DFlashDraftModel:
    cfg = DFlashConfig.from_dict(ck.drafter_config(head_dim=32, layers=2, **overrides))
    mx.random.seed(11)
    drafter = DFlashDraftModel(cfg)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    mx.eval(drafter.parameters(), embed.parameters(), head.parameters())
    return drafter.bind(embed, head)


def _rounds(drafter, cache, graph, kept, rows=1, counts=None, seed=5):
    """Draft rounds after ``kept[r]`` new context rows (slot rows: ``counts[r]`` of them per row,
    host lists or device arrays); each round's logits."""
    mx.random.seed(seed)
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    out = []
    for r, S in enumerate(kept):
        feats = mx.random.normal((rows, S, F)) * 0.5
        block = mx.array([[3 + r + i] + [drafter.mask_token_id] * (B - 1) for i in range(rows)])
        if counts is not None:
            for c in cache:
                c.prepare(lengths=counts[r])
        out.append(drafter(block.astype(mx.int32), feats, cache, graph))
        mx.eval(out[-1], [c.state for c in cache])
    return out


def _prompted(drafter, cache, rows=1, n=6):
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    drafter.add_context(mx.random.normal((rows, n, F), key=mx.random.key(1)) * 0.5, cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # full attention, the block not causal (the z-lab Qwen3.5 drafters)
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
        {"is_causal": True},
    ],
    ids=["full", "sliding", "causal"],
)
def test_one_sequence_graph_drafts_what_the_layer_path_drafts(graph_on, overrides):
    drafter = _drafter(**overrides)
    graph = drafter.graph(B)
    ref_cache = _prompted(drafter, drafter.make_cache())
    got_cache = _prompted(drafter, drafter.make_cache())
    kept = [3, 8, 1, 19, 5, 2]  # a full block's context, one row, more than two blocks
    ref = _rounds(drafter, ref_cache, None, kept)
    got = _rounds(drafter, got_cache, graph, kept)
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape == (1, B - 1, drafter.config.vocab_size)
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-5), float(mx.abs(a - b).max())
    n = 6 + sum(kept)
    for rc, gc in zip(ref_cache, got_cache, strict=True):
        assert type(gc) is KVCache and rc.offset == gc.offset == n
        assert mx.allclose(rc.keys[..., :n, :], gc.keys[..., :n, :], rtol=1e-5, atol=1e-6)
        assert mx.allclose(rc.values[..., :n, :], gc.values[..., :n, :], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lagged", [False, True], ids=["host-counts", "device-counts"])
def test_slot_rows_graph_drafts_what_the_layer_path_drafts(graph_on, lagged):
    drafter = _drafter()
    graph = drafter.graph(B)
    counts = [[3, 1], [8, 5], [1, 8], [0, 2], [11, 4]]  # ragged; a row keeping none; > a block
    ref_cache = _prompted(drafter, make_slot_draft_cache(drafter, 2), rows=2)
    got_cache = _prompted(drafter, make_slot_draft_cache(drafter, 2), rows=2)
    for c in got_cache:
        c.lagged = lagged
    dev = [mx.array(n, dtype=mx.int32) for n in counts] if lagged else counts
    kept = [max(n) or 1 for n in counts]
    ref = _rounds(drafter, ref_cache, None, kept, rows=2, counts=counts)
    got = _rounds(drafter, got_cache, graph, kept, rows=2, counts=dev)
    for a, b in zip(ref, got, strict=True):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-5), float(mx.abs(a - b).max())
    ends = [6 + sum(n[r] for n in counts) for r in range(2)]
    for rc, gc in zip(ref_cache, got_cache, strict=True):
        assert gc.offset.tolist() == ends and rc.lengths == ends
        if lagged:  # the host's bounds cover the rows until a resync makes them exact
            assert all(b >= e for b, e in zip(gc.lengths, ends, strict=True))
        else:
            assert gc.lengths == ends
        for r, n in enumerate(ends):
            for x, y in ((rc.keys, gc.keys), (rc.values, gc.values)):
                assert mx.allclose(x[r, :, :n], y[r, :, :n], rtol=1e-5, atol=1e-6)


def test_one_trace_whatever_a_round_kept_and_new_weights_trace_again(graph_on, monkeypatch):
    drafter = _drafter()
    traced = []
    real = draft_graph._layer

    def counted(lay, *a):  # runs only while MLX traces the graph
        traced.append(lay)
        return real(lay, *a)

    monkeypatch.setattr(draft_graph, "_layer", counted)
    cache = _prompted(drafter, drafter.make_cache())
    _rounds(drafter, cache, drafter.graph(B), [1, 8, 4, 2])
    assert len(traced) == len(drafter.layers)  # one trace for all four rounds
    _rounds(drafter, cache, drafter.graph(B), [12, 9])  # two blocks of new rows: one more
    assert len(traced) == 2 * len(drafter.layers)
    _rounds(drafter, cache, drafter.graph(B), [3])  # a later generation replays it
    assert len(traced) == 2 * len(drafter.layers)
    # New weights (a checkpoint loaded into the same model): traced again, and followed.
    mlp = drafter.layers[-1].mlp
    mlp.down_proj.weight = -mlp.down_proj.weight
    ref_cache = _prompted(drafter, drafter.make_cache())
    got_cache = _prompted(drafter, drafter.make_cache())
    ref = _rounds(drafter, ref_cache, None, [4])
    got = _rounds(drafter, got_cache, drafter.graph(B), [4])
    assert len(traced) == 3 * len(drafter.layers)
    assert mx.allclose(ref[0], got[0], rtol=1e-4, atol=1e-5)


def test_the_graph_takes_full_blocks_over_the_caches_it_writes(graph_on, monkeypatch):
    drafter = _drafter()
    graph = drafter.graph(B)
    F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    block = mx.zeros((1, B), dtype=mx.int32)
    held = _prompted(drafter, drafter.make_cache())
    assert graph.takes(block, mx.zeros((1, 3, F)), held)
    assert graph.takes(block, mx.zeros((1, B, F)), held)
    assert not graph.takes(block[:, :5], mx.zeros((1, 3, F)), held)  # a last, shorter block
    assert graph.takes(block, mx.zeros((1, B + 1, F)), held)  # context after lookup rounds
    assert not graph.takes(block, mx.zeros((1, 4 * B + 1, F)), held)  # more than 4 blocks
    assert not graph.takes(block, mx.zeros((1, 3, F)), drafter.make_cache())  # nothing held yet
    rotating = [RotatingKVCache(max_size=64) for _ in drafter.layers]
    assert not graph.takes(block, mx.zeros((1, 3, F)), _prompted(drafter, rotating))
    slots = _prompted(drafter, [SlotKVCache(2) for _ in drafter.layers], rows=2)
    assert graph.takes(mx.zeros((2, B), dtype=mx.int32), mx.zeros((2, 3, F)), slots)
    # the switch, read once a generation; a bad value names the fix
    monkeypatch.delenv(select.COMPILE_DRAFT_ENV)
    on_by_default = select.backend() == "cuda"
    assert select.compile_draft_enabled() == on_by_default
    assert isinstance(drafter.graph(B), CompiledDraft) == on_by_default
    assert ("draft one compiled graph" in select.summary()) == on_by_default
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "0")
    assert drafter.graph(B) is None and not select.compile_draft_enabled()
    assert "draft one compiled graph" not in select.summary()
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "1")
    assert isinstance(drafter.graph(B), CompiledDraft)
    assert "draft one compiled graph (full blocks)" in select.summary()
    monkeypatch.setenv(select.COMPILE_DRAFT_ENV, "yes")
    with pytest.raises(Exception, match="HF2Q_COMPILE_DRAFT='yes' must be 0 or 1"):
        drafter.graph(B)


def _counting(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = CompiledDraft.__call__

    def counted(self, block, features, cache):  # the real graph; count what it drafted
        calls.append((block.shape[0], features.shape[1] > block.shape[1]))
        return real(self, block, features, cache)

    monkeypatch.setattr(CompiledDraft, "__call__", counted)
    return calls


def test_greedy_dflash_through_the_graph_equals_plain(fitted_pairs, graph_on, monkeypatch):
    from hf2q.runtime.dflash import dflash_generate, plain_generate, run

    calls = _counting(monkeypatch)
    for name in ("qwen35", "qwen35_causal"):  # the second drafter has sliding-window layers
        lm, target, drafter = load_fitted(*fitted_pairs[name])
        eos = lm.tokenizer.eos_token_ids
        for i, text in enumerate(FIT_TEXTS[:3]):
            prompt = lm.tokenizer.encode(text)
            n = 18 + 9 * i
            want = run(plain_generate(target, prompt, max_tokens=n, eos_token_ids=eos)).tokens
            for block in (4, 16):
                for lookup in (False, True):
                    got = run(
                        dflash_generate(
                            target,
                            drafter,
                            prompt,
                            max_tokens=n,
                            block_size=block,
                            eos_token_ids=eos,
                            lagged=False,
                            lookup=lookup,
                        )
                    )
                    assert got.tokens == want, f"{name} prompt {i} block {block} lookup {lookup}"
    assert {r for r, _ in calls} == {1}
    # The demo pair drafts by lookup in runs, after which the drafter catches up on more than a
    # block of rows: through the graph too (padded to whole blocks).
    from hf2q.runtime.bench import BenchConfig, make_prompts
    from hf2q.runtime.pair import load_pair

    pair = load_pair(None, None)
    calls.clear()
    prompt = make_prompts(BenchConfig(), 1, tokenizer=pair.tokenizer)[0]
    want = run(plain_generate(pair.target, prompt, max_tokens=128)).tokens
    events = dflash_generate(
        pair.target, pair.drafter, prompt, max_tokens=128, block_size=4, lookup=True
    )
    got = run(events)
    assert got.tokens == want and got.lookup_rounds
    assert any(more for _, more in calls)


@pytest.mark.parametrize("lagged", [False, True], ids=["sync", "lagged"])
def test_batched_rounds_through_the_graph_equal_plain(lagged, fitted_pairs, graph_on, monkeypatch):
    calls = _counting(monkeypatch)
    assert_fitted_batched_equals_plain(fitted_pairs, lagged=lagged)
    assert 3 in {r for r, _ in calls}  # full blocks of every row through the graph
