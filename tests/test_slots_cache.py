"""Slot caches: rows with their own lengths behave exactly like separate single-sequence caches.

- ``SlotKVCache`` rows hold what mlx-lm's ``KVCache`` holds for each sequence, masks are each
  row's causal mask, and ragged rollback / ragged appends move only that row;
- after a batched verify of rows with different prompts and a ragged rollback, every row's
  caches (attention KV and Gated-DeltaNet conv + recurrent state) equal a fresh single run over
  that row's committed tokens, and decoding continues identically;
- the drafter's attention over ragged contexts equals running each row alone.
"""

from __future__ import annotations

import graph_ops
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from hf2q.kernels import select
from hf2q.loading import load_model
from hf2q.runtime.cache import GDNRollbackCache, make_target_cache
from hf2q.runtime.dflash import prefill
from hf2q.runtime.drafter import load_drafter
from hf2q.runtime.slot_cache import (
    SlotKVCache,
    insert_draft_rows,
    make_slot_draft_cache,
    make_slot_target_cache,
)
from hf2q.runtime.target import TargetModel
from hf2q.runtime.verify import verify_forward

TEXT = "def add(a, b):\n    return a + b\nclass Counter:\n    def __init__(self):\n        self.count = 0"
_loaded: dict[str, tuple] = {}


def _target(request, name: str):
    if name not in _loaded:
        lm = load_model(request.getfixturevalue(name))
        _loaded[name] = (TargetModel(lm.model, lm.tokenizer), lm.tokenizer.encode(TEXT))
    return _loaded[name]


# On the CPU a batched verify and a fresh run agree to 1e-6. On a GPU the fresh run's prefill (p rows)
# and the verify (6 rows a slot) take GEMMs tiled for their row counts, so float32 sums land a few
# ulps apart: the H200 measured at most 1.3e-6 (benchmarks/results/h200/session28/run1), the same
# with the one-row write as a slice or a scatter. Token equality is the contract the bf16 GPU
# tests hold bit-exact; this bound checks the state, not the GEMM's summation order. Comparisons
# of copies (cache rows against mlx-lm's caches) keep 1e-6 everywhere. (The next-logits check,
# after the states, has not yet been reached on a GPU.)
FRESH_ATOL = 1e-6 if select.backend() == "cpu" else 1e-5


def _close(a: mx.array, b: mx.array, what: str, atol: float = 1e-6) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=atol, err_msg=what)


def test_slot_kv_rows_hold_what_separate_kv_caches_hold():
    mx.random.seed(0)
    H, D, lens = 2, 8, [0, 5, 9]
    singles = [KVCache() for _ in lens]
    slot = SlotKVCache(len(lens))
    for r, n in enumerate(lens):
        if n:
            k, v = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
            singles[r].update_and_fetch(k, v)
            slot.insert(r, singles[r].keys, singles[r].values, singles[r].offset)
    assert slot.offset.tolist() == lens and slot.lengths == lens

    def step(L: int, keep: list[int] | None = None) -> None:
        k, v = mx.random.normal((3, H, L, D)), mx.random.normal((3, H, L, D))
        mask = slot.make_mask(L)  # built before the write, as mlx-lm's models do
        if keep is not None:
            slot.prepare(lengths=keep)
        K, V = slot.update_and_fetch(k, v)
        assert mask.shape == (3, 1, L, K.shape[2])
        for r, c in enumerate(singles):
            n = c.offset
            want = create_causal_mask(L, offset=n)  # (L, n + L)
            got = np.array(mask[r, 0])
            np.testing.assert_array_equal(got[:, : n + L], np.array(want))
            assert not got[:, n + L :].any()  # nothing past the row's own end
            c.update_and_fetch(k[r : r + 1], v[r : r + 1])
            if keep is not None:
                c.trim(L - keep[r])
            ks, vs = c.keys_and_values()
            assert slot.lengths[r] == c.offset
            _close(K[r : r + 1, :, : c.offset], ks, f"keys row {r}")
            _close(V[r : r + 1, :, : c.offset], vs, f"values row {r}")
            _close(slot.row(r)[0], ks, f"row() {r}")

    step(4)
    slot.rollback([0, 3, 4])
    for c, d in zip(singles, [0, 3, 4]):
        c.trim(d)
    assert slot.offset.tolist() == [4, 6, 9]
    step(2, keep=[2, 1, 0])  # ragged append: each row keeps its own count
    step(1)
    # A window limits what every row sees.
    win = np.array(slot.make_mask(3, window_size=2))
    for r, n in enumerate(slot.lengths):
        np.testing.assert_array_equal(
            win[r, 0, :, : n + 3], np.array(create_causal_mask(3, offset=n, window_size=2))
        )
    with pytest.raises(ValueError, match="cannot drop"):
        slot.rollback([0, 0, 99])
    # Aligned rows are plain causal attention: mlx-lm's own mask values (fused attention path).
    slot.rollback([m - 4 for m in slot.lengths])
    assert slot.aligned and slot.make_mask(1) is None and slot.make_mask(3) == "causal"
    assert slot.make_mask(3, return_array=True).shape == (3, 1, 3, 7)


@pytest.mark.parametrize("name", ["qwen35_dir", "qwen35_moe_dir", "qwen3_dir"])
def test_ragged_rollback_restores_each_row_exactly_as_a_fresh_run(name, request):
    target, ids = _target(request, name)
    starts = [3, 11, 6]  # prompt lengths per row
    T = 6
    rows = len(starts)
    batch = make_slot_target_cache(target, rows)
    for r, n in enumerate(starts):
        one = make_target_cache(target)
        prefill(target, ids[:n], one)
        mx.eval([c.state for c in one])
        batch.insert(r, one)
    pos = list(starts)
    for keep in ([1, 4, 6], [6, 1, 3]):  # two rounds: rows accept different counts
        block = mx.array([ids[p : p + T] for p in pos])  # (rows, T), different tokens per row
        verify_forward(target, block, batch)
        dropped = batch.rollback(keep)
        assert dropped == [T - k for k in keep] and batch.pending == 0
        pos = [p + k for p, k in zip(pos, keep)]
        assert batch.lengths == pos
    for r, p in enumerate(pos):
        fresh = target.make_cache()
        target.forward(mx.array([ids[:p]]), fresh)
        for i, (b, f) in enumerate(zip(batch, fresh)):
            if isinstance(b, SlotKVCache):
                k, v = b.row(r)
                fk, fv = f.keys_and_values()
                assert b.lengths[r] == f.offset
                _close(k, fk, f"row {r} layer {i} keys", FRESH_ATOL)
                _close(v, fv, f"row {r} layer {i} values", FRESH_ATOL)
            else:
                assert isinstance(b, GDNRollbackCache)
                for e, (x, y) in enumerate(zip(b.cache, f.cache)):
                    _close(x[r : r + 1], y, f"row {r} layer {i} state {e}", FRESH_ATOL)
    # Decoding goes on identically: one batched step equals each row's own next step.
    nxt = [ids[p] for p in pos]
    logits = target.model(mx.array(nxt)[:, None], cache=batch)
    for r, p in enumerate(pos):
        fresh = target.make_cache()
        target.forward(mx.array([ids[:p]]), fresh)
        want = target.model(mx.array([[nxt[r]]]), cache=fresh)
        _close(logits[r : r + 1], want, f"row {r} next logits", FRESH_ATOL)


def test_slot_cache_refuses_misuse(request):
    target, ids = _target(request, "qwen35_dir")
    batch = make_slot_target_cache(target, 2)
    with pytest.raises(RuntimeError, match="verify forward first"):
        batch.rollback([1, 1])
    for r in range(2):
        one = make_target_cache(target)
        prefill(target, ids[:4], one)
        batch.insert(r, one)
    verify_forward(target, mx.array([ids[4:8], ids[4:8]]), batch)
    with pytest.raises(ValueError, match="n_keep must be in 1..4"):
        batch.rollback([0, 2])
    with pytest.raises(ValueError, match="one value per row"):
        batch.rollback([1, 2, 3])
    with pytest.raises(AttributeError, match="one offset per row"):
        _ = batch.offset


@pytest.mark.parametrize("pair", ["qwen35_causal", "random"])
def test_batched_drafter_over_ragged_contexts_equals_each_row_alone(pair, fitted_pairs, tmp_path):
    import checkpoints as ck

    if pair == "random":
        tdir = fitted_pairs["qwen35"][0]
        ddir = ck.build_drafter(tmp_path / "d", layers=2, seed=5)
    else:
        tdir, ddir = fitted_pairs[pair]
    lm = load_model(tdir)
    target = TargetModel(lm.model, lm.tokenizer)
    drafter = load_drafter(ddir).bind(target.embed, target.head)
    ids = lm.tokenizer.encode(TEXT)
    n_ids = drafter.config.target_layer_ids
    _, feats = target.forward(mx.array([ids]), None, capture=n_ids)  # (1, L, F)
    mask_id = drafter.mask_token_id
    # Row r: prompt context ctx0[r] rows, then a round that appends new[r] rows and drafts.
    ctx0, new, L = [2, 9, 5], [3, 1, 2], 6
    rows = len(ctx0)
    batch = make_slot_draft_cache(drafter, rows)
    singles = []
    for r in range(rows):
        one = drafter.make_cache()
        drafter.add_context(feats[:, : ctx0[r]], one)
        insert_draft_rows(batch, r, one)
        singles.append(one)
    S = max(new)
    ctx = mx.stack(
        [
            mx.pad(feats[0, ctx0[r] : ctx0[r] + new[r]], [(0, S - new[r]), (0, 0)])
            for r in range(rows)
        ]
    )  # (rows, S, F), padded rows past each row's own count
    block = mx.array([[ids[ctx0[r] + new[r]]] + [mask_id] * (L - 1) for r in range(rows)])
    for c in batch:
        c.prepare(lengths=new)
    got = drafter(block, ctx, batch)  # (rows, L-1, V)
    for r in range(rows):
        want = drafter(block[r : r + 1], feats[:, ctx0[r] : ctx0[r] + new[r]], singles[r])
        _close(got[r : r + 1], want, f"row {r} draft logits")
        assert batch[0].lengths[r] == ctx0[r] + new[r]


def test_lagged_rows_keep_bounds_above_their_offsets_and_resync_exactly():
    # Lagged rounds: writes, ragged appends and rollbacks by counts the host has not read; the
    # host lengths stay upper bounds, and a resync from a mark makes them exact plus what was
    # written since.
    c = SlotKVCache(2)
    c.lagged = True
    kv = lambda L: (mx.ones((2, 1, L, 4)), mx.ones((2, 1, L, 4)))  # noqa: E731
    c.update_and_fetch(*kv(3))
    assert c.lengths == [3, 3] and not c.aligned
    c.prepare(lengths=mx.array([1, 3]))
    c.update_and_fetch(*kv(4))  # appends 4 rows, keeps 1 and 3
    first = c.mark()
    c.update_and_fetch(*kv(5))
    c.rollback(mx.array([2, 5]))  # a verify of 5, keeping 3 and 0
    c.trim(0)
    assert c.offset.tolist() == [7, 6] and c.lengths == [12, 12]  # bounds only
    c.resync(first)
    assert c.lengths == [4 + 5, 6 + 5]  # exact at the mark, plus the 5 written since
    c.resync(c.mark())
    assert c.lengths == c.offset.tolist() == [7, 6]
    with pytest.raises(ValueError):
        c.rollback([9, 0])  # host counts are still checked


@pytest.mark.parametrize("lagged", [False, True], ids=["host-counts", "device-counts"])
def test_layers_in_step_share_their_position_arithmetic(lagged, monkeypatch):
    # The layers of one model hold the same positions: their ragged writes, advances and
    # rollbacks build the positions once (graph nodes the host would encode per layer), and
    # each layer still holds exactly what a cache of its own holds.
    from hf2q.runtime import slot_cache

    monkeypatch.setattr(slot_cache, "_SHARED", slot_cache._Shared())  # nothing built before
    layers = [SlotKVCache(3) for _ in range(4)]
    alone = SlotKVCache(3)
    for c in (*layers, alone):
        for r, n in enumerate([3, 5, 2]):
            c.insert(r, mx.ones((1, 2, n, 4)) * r, mx.ones((1, 2, n, 4)) * -r, n)
    for c in layers:
        c.lagged = lagged
    mx.eval([c.state for c in (*layers, alone)])
    assert len({id(c.offset) for c in layers}) == 1
    new = [mx.random.normal((3, 2, 4, 4), key=mx.random.key(i)) for i in range(2)]
    # A lagged round's counts: one device array for every layer, as the slot loop passes them.
    grow = mx.array([4, 1, 2]) if lagged else [4, 1, 2]
    drop = mx.array([1, 0, 2]) if lagged else [1, 0, 2]
    mx.eval(new, grow, drop)
    for c in layers:
        c.prepare(lengths=grow)
        c.update_and_fetch(*new)
        c.rollback(drop)
    ops = graph_ops.ops(*[a for c in layers for a in c.state])
    assert ops.count("Arange") == 1, ops  # one set of write positions
    assert ops.count("ScatterAxis") == 2 * len(layers)  # each layer writes its keys and values
    assert ops.count("Add") == 2 and ops.count("Subtract") == 1, ops  # positions, advance, drop
    assert len({id(c.offset) for c in layers}) == 1
    alone.prepare(lengths=[4, 1, 2])  # a cache of its own, host counts
    alone.update_and_fetch(*new)
    alone.rollback([1, 0, 2])
    for c in layers:
        for got, want in zip(c.state, alone.state, strict=True):
            assert mx.array_equal(got, want).item()
    assert alone.offset.tolist() == [6, 6, 2]


@pytest.mark.parametrize("scatter", ["0", "1", None], ids=["slice", "scatter", "default"])
def test_a_lagged_single_row_holds_what_a_host_counted_row_holds(scatter, monkeypatch):
    # A lagged round at one slot writes at an offset only the device knows, by a slice update or
    # (HF2Q_KV_ROW_SCATTER=1, the default on CUDA) by the many-row caches' scatter: either way the
    # row holds exactly what the same writes with host counts leave, through ragged appends and
    # rollbacks.
    if scatter is None:
        monkeypatch.delenv("HF2Q_KV_ROW_SCATTER", raising=False)
        scatter = "1" if select.backend() == "cuda" else "0"
    else:
        monkeypatch.setenv("HF2Q_KV_ROW_SCATTER", scatter)
    lagged, host = SlotKVCache(1), SlotKVCache(1)
    for c in (lagged, host):
        c.insert(0, mx.ones((1, 2, 3, 4)), -mx.ones((1, 2, 3, 4)), 3)
    lagged.lagged = True
    mx.eval(lagged.state, host.state)
    for i, (grow, drop) in enumerate([(5, 2), (1, 0), (4, 3)]):
        new = [mx.random.normal((1, 2, 5, 4), key=mx.random.key(10 * i + j)) for j in range(2)]
        lagged.prepare(lengths=mx.array([grow]))
        host.prepare(lengths=[grow])
        for c in (lagged, host):
            c.update_and_fetch(*new)
        if i == 0:  # the switch picks the write
            ops = graph_ops.ops(*lagged.state)
            assert ("ScatterAxis" in ops) == (scatter == "1"), ops
            assert ("DynamicSliceUpdate" in ops) == (scatter == "0"), ops
        lagged.rollback(mx.array([drop]))
        host.rollback([drop])
    lagged.resync(lagged.mark())
    assert lagged.lengths == host.lengths == [3 + 5 - 2 + 1 + 4 - 3]
    n = host.lengths[0]
    assert lagged.offset.tolist() == host.offset.tolist() == [n]
    for got, want in zip(lagged.state[:2], host.state[:2], strict=True):
        assert mx.array_equal(got[..., :n, :], want[..., :n, :]).item()
