"""The compiled layer runners and ``HF2Q_FUSE_PROJ`` compute what the layer-call paths compute.

On CUDA the verify runs each Gated-DeltaNet decoder layer through one compiled runner (fused
kernel, per-step states kept as one buffer) and each attention layer through the compiled
attention runner, as plain decoding does there. Here (CPU) the same runners run with the ops
recurrence: logits, captured features and the caches after a rollback (uniform and ragged, one
sequence and slots) must equal the layer-call path's, and greedy DFlash with the runners must
still equal plain greedy decoding. ``HF2Q_FUSE_PROJ=1`` (one matmul for a layer's projections,
in the target's runners and in the drafter) must change none of it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIT_TEXTS, assert_greedy_dflash_equals_plain, load_fitted

import hf2q.runtime.verify as verify
from hf2q.errors import UsageError
from hf2q.kernels import select
from hf2q.loading import load_model
from hf2q.runtime.cache import GDNRollbackCache, make_target_cache
from hf2q.runtime.dflash import plain_generate, run
from hf2q.runtime.slot_cache import make_slot_target_cache
from hf2q.runtime.slots import Request, run_slots
from hf2q.runtime.target import TargetModel


def _close(a: mx.array, b: mx.array, what: str) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5, err_msg=what)


def _flat(state) -> list:
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _flat(s)]
    return [state]


def _caches_close(a, b) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for s, t in zip(_flat(x.state), _flat(y.state), strict=True):
            if s is None or t is None:
                assert s is None and t is None, f"layer {i}"
                continue
            _close(s, t, f"layer {i}")


@pytest.fixture
def target(qwen35_dir):
    lm = load_model(qwen35_dir)
    return TargetModel(lm.model, lm.tokenizer)


@pytest.mark.parametrize(
    ("fuse", "record"),
    [("0", "states"), ("1", "states"), ("0", "final")],
    ids=["separate-proj", "fused-proj", "final-state-record"],
)
def test_runner_verify_equals_layer_calls_and_rolls_back_alike(target, fuse, record, monkeypatch):
    monkeypatch.setenv(select.FUSE_PROJ_ENV, fuse)
    monkeypatch.setenv(select.GDN_RECORD_ENV, record)
    ids = mx.array([[(7 * i + 3) % 97 + 2 for i in range(30)]])
    capture = [0, target.num_layers - 1]
    caches = [make_target_cache(target), make_target_cache(target)]
    for c in caches:
        target.forward(ids[:, :9], c)
    pos = 9
    for T, keep in [(6, 2), (16, 16), (4, 1)]:
        block = ids[:, pos : pos + T]
        (l0, f0), (l1, f1) = (
            verify.verify_forward(target, block, c, capture=capture, runners=r)
            for c, r in zip(caches, (False, True))
        )
        _close(l1, l0, f"logits T={T}")
        _close(f1, f0, f"features T={T}")
        gdn = [c for c in caches[1] if isinstance(c, GDNRollbackCache)]
        if record == "states":
            assert gdn and all(c.record.stacked for c in gdn)  # the runner keeps one buffer
        else:  # the last state, and a replay of each row's kept steps
            n = block.shape[1]
            assert gdn and all(c.record.replay is not None and c.record.length == n for c in gdn)
        for c in caches:
            c.rollback(keep)
        _caches_close(caches[1], caches[0])
        pos += keep


@pytest.mark.parametrize("record", ["states", "final"])
def test_runner_verify_on_ragged_slot_rows(target, record, monkeypatch):
    monkeypatch.setenv(select.GDN_RECORD_ENV, record)
    prompts = [[5, 9, 13], [21, 4, 8, 30, 2, 17, 6], [11, 12, 13, 14, 15]]
    caches = [make_slot_target_cache(target, 3), make_slot_target_cache(target, 3)]
    for r, p in enumerate(prompts):
        one = make_target_cache(target)
        target.forward(mx.array([p]), one)
        for c in caches:
            c.insert(r, one)
    block = mx.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17]])
    outs = [
        verify.verify_forward(target, block, c, capture=[1], runners=r)
        for c, r in zip(caches, (False, True))
    ]
    _close(outs[1][0], outs[0][0], "logits")
    _close(outs[1][1], outs[0][1], "features")
    for c in caches:
        c.rollback([2, 5, 1])
    _caches_close(caches[1], caches[0])
    assert caches[1].lengths == caches[0].lengths == [5, 12, 6]


def test_unset_record_follows_the_record_size_and_rolls_back_alike(target, monkeypatch):
    # HF2Q_GDN_RECORD unset: a verify whose per-step record of a layer reaches
    # GDN_FINAL_MIN_BYTES keeps the final state, a smaller one every step's state; both roll back
    # to the layer-call path's caches. The threshold is moved so that this tiny target's 4-row
    # verify of 5 tokens reaches it and its one-row verify does not.
    monkeypatch.delenv(select.GDN_RECORD_ENV, raising=False)
    rows, T = 4, 5
    monkeypatch.setattr(select, "GDN_FINAL_MIN_BYTES", rows * T * target.gdn_state_size * 4)
    prompts = [[5 + r, 9, 13 + 2 * r, 4][: 2 + r % 3] for r in range(rows)]
    for n, keep, final in ((rows, [2, 5, 1, 3], True), (1, [3], False)):
        caches = [make_slot_target_cache(target, n), make_slot_target_cache(target, n)]
        for r, p in enumerate(prompts[:n]):
            one = make_target_cache(target)
            target.forward(mx.array([p]), one)
            for c in caches:
                c.insert(r, one)
        block = mx.array([[(3 + 5 * r + i) % 90 + 2 for i in range(T)] for r in range(n)])
        outs = [
            verify.verify_forward(target, block, c, capture=[1], runners=r)
            for c, r in zip(caches, (False, True))
        ]
        _close(outs[1][0], outs[0][0], f"logits {n} rows")
        records = [c.record for c in caches[1] if isinstance(c, GDNRollbackCache)]
        assert records and all((r.replay is not None) == final for r in records)
        for c in caches:
            c.rollback(keep)
        _caches_close(caches[1], caches[0])


@pytest.mark.parametrize(
    ("name", "fuse", "record", "lagged"),
    [
        ("qwen35", "0", "states", "0"),
        ("qwen35", "1", "states", "0"),
        ("qwen35_causal", "0", "states", "0"),
        ("qwen35_causal", "1", "states", "0"),
        ("qwen35", "0", "final", "0"),
        ("qwen35", "0", "final", "1"),
    ],
)
def test_greedy_dflash_with_runners_equals_plain(
    name, fuse, record, lagged, fitted_pairs, monkeypatch
):
    monkeypatch.setattr(verify, "use_runners", lambda: True)  # the CUDA choice, here on ops
    monkeypatch.setenv(select.FUSE_PROJ_ENV, fuse)
    # HF2Q_GDN_RECORD=final: rollback by replaying each row's kept steps (on the device's
    # counts in lagged rounds, HF2Q_LAGGED_ROUNDS=1, CUDA's default).
    monkeypatch.setenv(select.GDN_RECORD_ENV, record)
    monkeypatch.setenv(select.LAGGED_ROUNDS_ENV, lagged)
    lm, target, drafter = load_fitted(*fitted_pairs[name])
    prompts = [lm.tokenizer.encode(t)[:5] for t in FIT_TEXTS[:3]]
    assert_greedy_dflash_equals_plain(
        target,
        drafter,
        prompts,
        [36 - 6 * i for i in range(len(prompts))],
        blocks=(3, 16),
        slots=2,
        eos=lm.tokenizer.eos_token_ids,
    )


def test_gdn_record_reads_the_environment(monkeypatch):
    monkeypatch.delenv(select.GDN_RECORD_ENV, raising=False)
    big = select.GDN_FINAL_MIN_BYTES
    assert select.gdn_record() == select.gdn_record(big - 1) == "states"
    assert select.gdn_record(big) == "final"
    monkeypatch.setenv(select.GDN_RECORD_ENV, "final")
    assert select.gdn_record() == "final"
    monkeypatch.setenv(select.GDN_RECORD_ENV, "states")
    assert select.gdn_record(big) == "states"
    monkeypatch.setenv(select.GDN_RECORD_ENV, "everything")
    with pytest.raises(UsageError, match="HF2Q_GDN_RECORD='everything' must be 'states' or"):
        select.gdn_record()


def test_fuse_proj_reads_the_environment_and_is_reported(monkeypatch):
    monkeypatch.delenv(select.FUSE_PROJ_ENV, raising=False)
    assert not select.fuse_proj_enabled() and "projections" not in select.describe()
    monkeypatch.setenv(select.FUSE_PROJ_ENV, "1")
    assert select.fuse_proj_enabled()
    assert "projections concatenated" in select.summary()
    monkeypatch.setenv(select.FUSE_PROJ_ENV, "maybe")
    with pytest.raises(
        UsageError, match="HF2Q_FUSE_PROJ='maybe' must be 0 or 1: unset it or fix it"
    ):
        select.fuse_proj_enabled()


def test_batched_plain_with_runners_equals_single_plain(fitted_pairs, monkeypatch):
    # On CUDA batched plain decoding steps through hf2q's compiled layers (decode_layer_fn), with
    # the slot caches' ragged rows; here the same layer function runs on ops.
    import hf2q.runtime.slots as slots
    from hf2q.kernels.layers import fast_layer_fn
    from hf2q.runtime.slots import slots_plain_generate

    monkeypatch.setattr(slots, "decode_layer_fn", lambda: fast_layer_fn())
    target_dir, _ = fitted_pairs["qwen35"]
    lm = load_model(target_dir)
    target = TargetModel(lm.model, lm.tokenizer)
    prompts = [lm.tokenizer.encode(t)[: 3 + 2 * i] for i, t in enumerate(FIT_TEXTS[:4])]
    want = [
        run(plain_generate(target, p, max_tokens=20 + 3 * i)).tokens for i, p in enumerate(prompts)
    ]
    reqs = [Request(p, max_tokens=20 + 3 * i) for i, p in enumerate(prompts)]
    got = run_slots(slots_plain_generate(target, reqs, slots=3))
    assert [s.tokens for s in got.requests] == want


def _draft_logits(target, drafter, ids):
    """Drafter logits of one sequence over two rounds and of three ragged slot rows."""
    from hf2q.runtime.slot_cache import insert_draft_rows, make_slot_draft_cache

    n_ids = drafter.config.target_layer_ids
    _, feats = target.forward(mx.array([ids]), None, capture=n_ids)  # (1, L, F)
    mask_id = drafter.mask_token_id
    outs = []
    one = drafter.make_cache()
    drafter.add_context(feats[:, :5], one)
    for lo, hi in ((5, 8), (8, 9)):
        block = mx.array([[ids[hi]] + [mask_id] * 5])
        outs.append(drafter(block, feats[:, lo:hi], one))
    ctx0, new = [2, 7, 4], [3, 1, 2]
    batch = make_slot_draft_cache(drafter, 3)
    for r in range(3):
        c = drafter.make_cache()
        drafter.add_context(feats[:, : ctx0[r]], c)
        insert_draft_rows(batch, r, c)
    ctx = mx.stack(
        [mx.pad(feats[0, ctx0[r] : ctx0[r] + new[r]], [(0, 3 - new[r]), (0, 0)]) for r in range(3)]
    )
    for c in batch:
        c.prepare(lengths=new)
    block = mx.array([[ids[ctx0[r] + new[r]]] + [mask_id] * 5 for r in range(3)])
    outs.append(drafter(block, ctx, batch))
    return outs


def test_drafter_with_concatenated_projections_drafts_the_same(fitted_pairs, monkeypatch):
    from mlx.utils import tree_flatten

    lm, target, drafter = load_fitted(
        *fitted_pairs["qwen35_causal"]
    )  # 3 layers, sliding-window layers
    ids = lm.tokenizer.encode(FIT_TEXTS[0] + " " + FIT_TEXTS[1])
    names = sorted(k for k, _ in tree_flatten(drafter.parameters()))
    monkeypatch.setenv(select.FUSE_PROJ_ENV, "0")
    want = _draft_logits(target, drafter, ids)
    monkeypatch.setenv(select.FUSE_PROJ_ENV, "1")
    got = _draft_logits(target, drafter, ids)
    assert all("_qkv" in x.self_attn.__dict__ and "_gate_up" in x.__dict__ for x in drafter.layers)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        _close(a, b, f"draft {i}")
    # The concatenated copies are not parameters: saving or training sees the same tensors.
    assert sorted(k for k, _ in tree_flatten(drafter.parameters())) == names
    # Replacing a weight (a dtype cast, a training step) rebuilds the concatenation.
    layer = drafter.layers[0]
    layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * 0.5
    layer.mlp.up_proj.weight = layer.mlp.up_proj.weight * 2.0
    got = _draft_logits(target, drafter, ids)
    monkeypatch.setenv(select.FUSE_PROJ_ENV, "0")
    want = _draft_logits(target, drafter, ids)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        _close(a, b, f"draft {i} after new weights")
