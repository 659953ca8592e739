"""Verify forward and exact rollback: equal to mlx-lm's own layers and to a fresh run.

- the recurrence with per-step states equals mlx-lm's ops recurrence bit for bit;
- a verify layer equals mlx-lm's ``DecoderLayer.__call__`` on the same input and cache;
- verify logits/features equal a plain forward;
- after a verify and ``rollback(n_keep)`` for every n_keep, every layer's cache equals the cache
  of a fresh plain run over the committed tokens (states compared directly).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from hf2q.kernels.gated_delta import gated_delta_steps, gated_delta_steps_reference
from hf2q.kernels.select import backend, recurrence_impl
from hf2q.loading import load_model
from hf2q.runtime.cache import GDNRollbackCache, TargetCache, make_target_cache
from hf2q.runtime.target import TargetModel
from hf2q.runtime.verify import verify_forward, verify_layer

#: On the CPU these paths agree bit for bit (or to 1e-6); on a GPU the verify, the fused kernels
#: and plain forwards of other lengths run different kernels, whose float32 results agree to a
#: relative error of 1e-5 (the kernels' contract, tests/test_kernels_*.py).
ON_CPU = backend() == "cpu"


def _assert_close(a, b, msg: str = "") -> None:
    a, b = np.array(a), np.array(b)
    if ON_CPU:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=msg)
        return
    assert a.shape == b.shape, msg
    err = float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))
    assert err <= 1e-5, f"{msg}: relative error {err:.2e}"


def _assert_same(a: mx.array, b: mx.array) -> None:
    """Bit-identical on the CPU; within the kernels' contract elsewhere."""
    if ON_CPU:
        assert mx.array_equal(a, b).item()
    else:
        _assert_close(a, b)


TEXT = "def add(a, b):\n    return a + b\nclass Counter:\n    def __init__(self):"
TARGETS = ["qwen35_dir", "qwen35_causal_dir", "qwen35_moe_dir", "qwen3_dir"]
_loaded: dict[str, tuple] = {}


def _target(request, name: str):
    if name not in _loaded:
        lm = load_model(request.getfixturevalue(name))
        _loaded[name] = (TargetModel(lm.model, lm.tokenizer), lm.tokenizer.encode(TEXT))
    return _loaded[name]


def _inputs(B, T, Hk, Hv, Dk, Dv, seed=0):
    mx.random.seed(seed)
    return (
        mx.random.normal((B, T, Hk, Dk)) * 0.3,
        mx.random.normal((B, T, Hk, Dk)) * 0.3,
        mx.random.normal((B, T, Hv, Dv)),
        mx.random.uniform(0.5, 1.0, shape=(B, T, Hv)),
        mx.random.uniform(shape=(B, T, Hv)),
        mx.random.normal((B, Hv, Dv, Dk)),
    )


@pytest.mark.parametrize("shape", [(1, 16, 2, 4, 16, 8), (2, 5, 4, 4, 32, 16), (1, 1, 1, 2, 8, 8)])
def test_recurrence_with_states_is_bit_identical_to_mlx_lm_ops(shape):
    # Bit-identical where the ops run; on CUDA gated_delta_steps dispatches to hf2q's kernel,
    # whose float32 contract is a relative error of at most 1e-5 (tests/test_kernels_*.py).
    q, k, v, g, beta, state = _inputs(*shape)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    # (On a GPU even the compiled ops round differently from mlx-lm's uncompiled ones.)
    kernel = recurrence_impl(q, v, state) == "cuda"

    def same(a: mx.array, b: mx.array, exact: bool) -> bool:
        if exact and ON_CPU:
            return mx.array_equal(a, b).item()
        return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item() <= 1e-5

    for fn in (gated_delta_steps_reference, gated_delta_steps):
        exact = fn is gated_delta_steps_reference or not kernel
        y, states = fn(q, k, v, g, beta, state)
        assert len(states) == shape[1]
        assert all(s.shape == (shape[0], shape[3], shape[5], shape[4]) for s in states)
        assert all(s.dtype == mx.float32 for s in states)
        assert same(y, y_ref, exact) and same(states[-1], s_ref, exact)
    # Every intermediate state is the state after that many steps.
    for t in range(shape[1]):
        _, s_t = gated_delta_ops(
            q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], state
        )
        assert same(states[t], s_t, not kernel)


def test_masked_steps_carry_the_state_over_like_mlx_lm():
    q, k, v, g, beta, state = _inputs(2, 6, 2, 4, 16, 8, seed=1)
    mask = mx.array([[False, False, True, True, True, True], [True] * 6])
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state, mask)
    y, states = gated_delta_steps(q, k, v, g, beta, state, mask)
    assert mx.array_equal(y, y_ref) and mx.array_equal(states[-1], s_ref)
    assert mx.array_equal(states[1][0], state[0])


@pytest.mark.parametrize("name", ["qwen35_dir", "qwen35_moe_dir"])
def test_verify_layer_equals_mlx_lm_layer_call_on_same_input_and_state(name, request):
    target, ids = _target(request, name)
    P = 9
    ref = make_target_cache(target)
    target.forward(mx.array([ids[:P]]), ref)
    h = target.embed(mx.array([ids[P : P + 7]]))
    fa_mask, ssm_mask = target.masks(h, ref)
    checked = 0
    for i, layer in enumerate(target.layers):
        if not target.is_linear(i):
            continue
        mine, theirs = GDNRollbackCache(), GDNRollbackCache()
        mine.cache = list(ref[i].cache)
        theirs.cache = list(ref[i].cache)
        out = verify_layer(i, layer, h, ssm_mask, mine)
        want = layer(h, mask=ssm_mask, cache=theirs)
        _assert_close(out, want)
        for a, b in zip(mine.cache, theirs.cache):
            _assert_close(a, b)
        assert mine.record is not None and mine.record.length == 7
        checked += 1
    assert checked == 3


@pytest.mark.parametrize("name", TARGETS)
def test_verify_logits_and_features_equal_a_plain_forward(name, request):
    target, ids = _target(request, name)
    P = 10
    ids_cap = [0, 1, target.num_layers - 1]
    c1, c2 = make_target_cache(target), target.make_cache()
    target.forward(mx.array([ids[:P]]), c1)
    target.forward(mx.array([ids[:P]]), c2)
    l1, f1 = verify_forward(target, mx.array([ids[P : P + 16]]), c1, capture=ids_cap)
    l2, f2 = target.forward(mx.array([ids[P : P + 16]]), c2, capture=ids_cap)
    _assert_close(l1, l2)
    _assert_close(f1, f2)
    # mlx-lm's own model call on the same tokens gives the same logits too.
    c3 = target.make_cache()
    target.model(mx.array([ids[:P]]), cache=c3)
    _assert_close(target.model(mx.array([ids[P : P + 16]]), cache=c3), l1)


def _assert_caches_equal(got: TargetCache, want: list) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if hasattr(a, "keys"):
            assert a.offset == b.offset, f"layer {i}"
            ka, va = a.keys_and_values()
            kb, vb = b.keys_and_values()
            pairs = [(ka, kb), (va, vb)]
        else:
            pairs = list(zip(a.cache, b.cache, strict=True))
        for x, y in pairs:
            assert x.shape == y.shape and x.dtype == y.dtype, f"layer {i}"
            _assert_close(x, y, f"layer {i}")


@pytest.mark.parametrize("name", TARGETS)
def test_rollback_after_any_accepted_count_equals_a_fresh_run(name, request):
    target, ids = _target(request, name)
    P, T = 8, 16
    block = mx.array([ids[P : P + T]])
    for n_keep in range(1, T + 1):  # a = n_keep - 1 accepted drafts, 0..B-1
        cache = make_target_cache(target)
        target.forward(mx.array([ids[:P]]), cache)
        verify_forward(target, block, cache)
        dropped = cache.rollback(n_keep)
        assert dropped == T - n_keep and cache.pending == 0
        assert cache.offset == P + n_keep
        fresh = target.make_cache()
        target.forward(mx.array([ids[: P + n_keep]]), fresh)
        _assert_caches_equal(cache, fresh)
        # And decoding continues identically from the restored caches.
        nxt = mx.array([[ids[P + n_keep]]])
        _assert_close(target.model(nxt, cache=cache), target.model(nxt, cache=fresh))


def test_repeated_verify_and_rollback_rounds_stay_exact(request):
    target, ids = _target(request, "qwen35_dir")
    cache = make_target_cache(target)
    target.forward(mx.array([ids[:4]]), cache)
    pos = 4
    for n_keep, T in [(1, 5), (3, 3), (2, 8), (8, 8), (1, 2)]:
        verify_forward(target, mx.array([ids[pos : pos + T]]), cache)
        cache.rollback(n_keep)
        pos += n_keep
    fresh = target.make_cache()
    target.forward(mx.array([ids[:pos]]), fresh)
    _assert_caches_equal(cache, fresh)


def test_batched_rows_roll_back_to_their_own_counts(request):
    target, ids = _target(request, "qwen35_dir")
    i = target.linear_layers[0]
    attn = target.layers[i].linear_attn
    x = target.embed(mx.array([ids[:6], ids[6:12]]))  # two rows
    cache = GDNRollbackCache()
    from hf2q.runtime.verify import gdn_verify

    gdn_verify(attn, x, None, cache)
    rec = cache.record
    cache.rollback([2, 5])
    K1 = attn.conv_kernel_size - 1
    assert mx.array_equal(cache[1][0], rec.after(2)[0])
    assert mx.array_equal(cache[1][1], rec.after(5)[1])
    assert mx.array_equal(cache[0][0], rec.conv_input[0, 2 : 2 + K1])
    assert mx.array_equal(cache[0][1], rec.conv_input[1, 5 : 5 + K1])


def test_stacked_record_rolls_back_like_the_list_record(request):
    # The fused CUDA verify keeps its per-step states as one (B, T, ...) array; rolling back from
    # it (uniform or ragged, one gather) must restore exactly what the per-step list restores.
    target, ids = _target(request, "qwen35_dir")
    attn = target.layers[target.linear_layers[0]].linear_attn
    x = target.embed(mx.array([ids[:6], ids[6:12], ids[12:18]]))  # three rows, T = 6
    from hf2q.runtime.verify import gdn_verify

    for keep in ([2, 5, 6], [4, 4, 4], 3, 6):
        listed = GDNRollbackCache()
        gdn_verify(attn, x, None, listed)
        rec = listed.record  # a list on the CPU, one buffer from the fused CUDA kernel
        steps = [rec.after(t + 1) for t in range(rec.length)]
        listed.set_record(rec.conv_input, steps)
        stacked = GDNRollbackCache()
        stacked[0], stacked[1] = listed[0], listed[1]  # what the verify left: the state after T
        stacked.set_record(rec.conv_input, mx.stack(steps, axis=1))
        assert stacked.record.length == listed.record.length == 6
        assert mx.array_equal(stacked.record.after(6), listed[1])
        listed.rollback(keep)
        stacked.rollback(keep)
        assert mx.array_equal(stacked[1], listed[1])
        assert mx.array_equal(stacked[0], listed[0])


def test_rollback_misuse_is_refused(request):
    target, ids = _target(request, "qwen35_dir")
    cache = make_target_cache(target)
    with pytest.raises(RuntimeError, match="verify forward first"):
        cache.rollback(1)
    target.forward(mx.array([ids[:4]]), cache)
    verify_forward(target, mx.array([ids[4:8]]), cache)
    with pytest.raises(ValueError, match="n_keep must be in 1..4"):
        cache.rollback(5)
    with pytest.raises(RuntimeError, match="neither rolled back nor committed"):
        verify_forward(target, mx.array([ids[4:8]]), cache)
    cache.commit()
    assert cache.offset == 8 and all(getattr(c, "record", None) is None for c in cache)


def test_compiled_verify_layer_equals_the_eager_one_bit_for_bit(request):
    from hf2q.runtime.verify import gdn_verify

    target, ids = _target(request, "qwen35_causal_dir")
    ref = make_target_cache(target)
    target.forward(mx.array([ids[:9]]), ref)
    x = target.embed(mx.array([ids[9:25]]))
    for i in target.linear_layers[:2]:
        attn = target.layers[i].linear_attn
        a, b = GDNRollbackCache(), GDNRollbackCache()
        a.cache, b.cache = list(ref[i].cache), list(ref[i].cache)
        out_c = gdn_verify(attn, x, None, a, compiled=True)
        out_e = gdn_verify(attn, x, None, b, compiled=False)
        _assert_same(out_c, out_e)
        for t in range(a.record.length):
            _assert_same(a.record.after(t + 1), b.record.after(t + 1))
        _assert_same(a.record.conv_input, b.record.conv_input)


def test_compiled_verify_layers_do_not_keep_a_freed_model(request):
    # A compiled trace keeps the weights it read: the compiled verify layer (the CPU path) must go
    # with its layer, or every model that ever verified would stay in memory.
    import gc
    import weakref

    from hf2q.runtime import verify

    lm = load_model(request.getfixturevalue("qwen35_dir"))  # its own copy: nothing else keeps it
    target = TargetModel(lm.model, lm.tokenizer)
    attn = target.layers[target.linear_layers[0]].linear_attn
    verify.gdn_verify(attn, target.embed(mx.array([[5, 7, 9, 11, 2]])), None, GDNRollbackCache())
    key, alive = id(attn), weakref.ref(attn)
    assert key in verify._compiled_layers
    del attn, target, lm
    gc.collect()
    assert alive() is None
    assert key not in verify._compiled_layers
