"""The one-launch Gated-DeltaNet rollback (hf2q/kernels/cuda_rollback.py) and its use by the caches.

On this CPU the kernel's own source runs in the CUDA emulator (tests/cuda_emu.py): it must copy
each row's kept conv rows and state of every layer exactly (checked against numpy indexing), and
a target cache rolled back through it after a real verify must hold bit for bit what the
per-layer ops rollback leaves (single sequence and ragged slot rows). The CUDA test runs the real
kernel.
"""

from __future__ import annotations

import cuda_emu
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from hf2q.errors import UsageError
from hf2q.kernels import cuda_rollback as cr
from hf2q.kernels import select
from hf2q.kernels.gdn import RowReplay
from hf2q.loading import load_model
from hf2q.runtime import cache as cache_mod
from hf2q.runtime import verify
from hf2q.runtime.cache import GDNRollbackCache, make_target_cache
from hf2q.runtime.slot_cache import make_slot_target_cache
from hf2q.runtime.target import TargetModel

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


class _Counted:
    """The emulated kernel, counting its launches."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def __call__(self, **kwargs):
        self.calls += 1
        return self.kernel(**kwargs)


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel's own source (emulated here, real on CUDA) with its launches counted; the
    caches are told the kernel applies, as they are on CUDA."""
    if HAS_CUDA:
        cr._launcher.cache_clear()  # compiled launches call the kernel function when traced
        cr._conv_launcher.cache_clear()
        real, counted = cr._kernel, {}
        monkeypatch.setattr(
            cr,
            "_kernel",
            lambda L, states=True: counted.setdefault((L, states), _Counted(real(L, states))),
        )
        return counted
    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")
    built: dict[tuple[int, bool], _Counted] = {}

    def emulated(layers: int, states: bool = True):
        if (layers, states) not in built:
            name, ins, outs, src = cr.spec(layers, states)
            built[layers, states] = _Counted(
                cuda_emu.EmulatedKernel(name, ins, outs, src, workdir=tmp_path)
            )
        return built[layers, states]

    monkeypatch.setattr(cr, "_kernel", emulated)
    monkeypatch.setattr(cache_mod, "rollback_kernel_enabled", lambda: True)
    return built


def _records(L, B, T, K1, C, state_shape, dtype, seed=0):
    mx.random.seed(seed)
    convs = [mx.random.normal((B, K1 + T, C)).astype(dtype) for _ in range(L)]
    states = [mx.random.normal((B, T, *state_shape)) for _ in range(L)]
    return convs, states


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_kernel_copies_each_rows_kept_conv_rows_and_state_of_every_layer(kernel, dtype):
    L, B, T, K1, C = 3, 3, 5, 3, 40
    convs, states = _records(L, B, T, K1, C, (2, 4, 8), dtype)
    keep = [1, 3, 5]
    conv_out, state_out = cr.rollback_cuda(convs, states, mx.array(keep, dtype=mx.int32))
    assert kernel[L, True].calls == 1  # every layer in one launch
    for c, s, co, so in zip(convs, states, conv_out, state_out, strict=True):
        assert co.dtype == dtype and co.shape == (B, K1, C) and so.shape == (B, 2, 4, 8)
        for b, n in enumerate(keep):
            assert mx.array_equal(co[b], c[b, n : n + K1])
            assert mx.array_equal(so[b], s[b, n - 1])


@pytest.mark.parametrize("dtype", [mx.bfloat16], ids=["bf16"])
def test_conv_kernel_copies_each_rows_kept_conv_rows_of_every_layer(kernel, dtype):
    L, B, T, K1, C = 3, 3, 5, 3, 40
    convs, _ = _records(L, B, T, K1, C, (2, 4, 8), dtype)
    keep = [1, 3, 5]
    conv_out = cr.rollback_conv_cuda(convs, mx.array(keep, dtype=mx.int32), T)
    assert kernel[L, False].calls == 1  # every layer in one launch, no state copied
    for c, co in zip(convs, conv_out, strict=True):
        assert co.dtype == dtype and co.shape == (B, K1, C)
        for b, n in enumerate(keep):
            assert mx.array_equal(co[b], c[b, n : n + K1])
    keep_arr = mx.array(keep, dtype=mx.int32)
    assert cr.conv_supported(convs, keep_arr, T) is None
    assert "different shapes" in cr.conv_supported([convs[0], convs[1][:, :5]], keep_arr, T)
    assert "int32" in cr.conv_supported(convs, keep_arr.astype(mx.int64), T)
    assert "does not hold" in cr.conv_supported(convs, keep_arr, K1 + T)


def test_supported_names_what_does_not_fit():
    convs, states = _records(2, 2, 4, 3, 8, (2, 2, 4), mx.float32)
    keep = mx.array([1, 4], dtype=mx.int32)
    assert cr.supported(convs, states, keep) is None
    assert "float32" in cr.supported(convs, [s.astype(mx.bfloat16) for s in states], keep)
    assert "different shapes" in cr.supported([convs[0], convs[1][:, :5]], states, keep)
    assert "int32" in cr.supported(convs, states, keep.astype(mx.int64))
    assert "float4" in cr.supported(convs[:1], [mx.zeros((2, 4, 1, 1, 3))], keep)


def test_the_switch_is_read_and_checked(monkeypatch):
    monkeypatch.setenv(select.ROLLBACK_KERNEL_ENV, "maybe")
    with pytest.raises(UsageError, match="HF2Q_ROLLBACK_KERNEL"):
        select.rollback_kernel_enabled()
    monkeypatch.setenv(select.ROLLBACK_KERNEL_ENV, "0")
    assert not select.rollback_kernel_enabled()
    monkeypatch.delenv(select.ROLLBACK_KERNEL_ENV)
    assert select.rollback_kernel_enabled() == (select.backend() == "cuda")


_TARGETS: dict[str, TargetModel] = {}


@pytest.fixture
def target(qwen35_dir):
    if "t" not in _TARGETS:
        _TARGETS["t"] = TargetModel(load_model(qwen35_dir).model)
    return _TARGETS["t"]


def _assert_caches_bit_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        for (_, a), (_, b) in zip(tree_flatten(g.state), tree_flatten(w.state), strict=True):
            assert (a is None and b is None) or mx.array_equal(a, b).item()
        if isinstance(g, GDNRollbackCache):
            assert g.record is None and w.record is None


IDS = [5, 9, 13, 21, 4, 8, 30, 2, 17, 6, 11, 12]


@pytest.mark.parametrize("n_keep", [1, 4, 7])
def test_target_cache_rollback_in_one_launch_equals_the_per_layer_rollback(
    kernel, target, monkeypatch, n_keep
):
    """After a real verify (per-step states stacked, as the runners keep them) the one-launch
    rollback leaves every layer bit-equal to the per-layer ops rollback."""
    caches = []
    for one_launch in (True, False):
        monkeypatch.setattr(cache_mod, "rollback_kernel_enabled", lambda v=one_launch: v)
        c = make_target_cache(target)
        target.forward(mx.array([IDS[:5]]), c)
        verify.verify_forward(target, mx.array([IDS[5:12]]), c, runners=True)
        assert all(x.record.stacked for x in c if isinstance(x, GDNRollbackCache))
        assert c.rollback(n_keep) == 7 - n_keep
        caches.append(c)
    launches = sum(k.calls for k in kernel.values())
    assert launches == (0 if n_keep == 7 else 1)
    _assert_caches_bit_equal(*caches)
    assert caches[0].offset == caches[1].offset == 5 + n_keep


def _verified_slots(target, monkeypatch, one_launch: bool):
    """Three slot rows of different prompt lengths after one verify of five tokens each, rolled
    back through the one-launch kernel or not."""
    monkeypatch.setattr(cache_mod, "rollback_kernel_enabled", lambda: one_launch)
    prompts = [[5, 9, 13], [21, 4, 8, 30, 2, 17, 6], [11, 12, 13, 14, 15]]
    block = mx.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17]])
    c = make_slot_target_cache(target, 3)
    for r, p in enumerate(prompts):
        one = make_target_cache(target)
        target.forward(mx.array([p]), one)
        c.insert(r, one)
    verify.verify_forward(target, block, c, runners=True)
    return c


def test_slot_rows_roll_back_to_their_own_counts_in_one_launch(kernel, target, monkeypatch):
    caches = []
    for one_launch in (True, False):
        c = _verified_slots(target, monkeypatch, one_launch)
        c.rollback([2, 5, 1])
        caches.append(c)
    assert sum(k.calls for k in kernel.values()) == 1
    _assert_caches_bit_equal(*caches)
    assert caches[0].lengths == caches[1].lengths == [5, 12, 6]


@pytest.mark.parametrize("lagged", [False, True], ids=["host-counts", "device-counts"])
def test_final_state_rows_roll_back_with_one_conv_launch(kernel, target, monkeypatch, lagged):
    """Final-state records (``HF2Q_GDN_RECORD=final``): every layer's kept conv rows in one
    launch and each layer's replay leave the slot rows bit-equal to the per-layer rollback."""
    monkeypatch.setenv(select.GDN_RECORD_ENV, "final")
    caches = []
    for one_launch in (True, False):
        c = _verified_slots(target, monkeypatch, one_launch)
        gdn = [x for x in c if isinstance(x, GDNRollbackCache)]
        assert all(isinstance(x.record.replay, RowReplay) for x in gdn)
        keep = [2, 5, 1]
        if lagged:
            for x in c:
                if not isinstance(x, GDNRollbackCache):
                    x.lagged = True
            c.rollback(mx.array(keep, dtype=mx.int32))
            for x in c:
                if not isinstance(x, GDNRollbackCache):
                    x.lagged = False
        else:
            c.rollback(keep)
        caches.append(c)
    assert {k: v.calls for k, v in kernel.items()} == {(len(gdn), False): 1}
    _assert_caches_bit_equal(*caches)


@cuda_only
def test_cuda_kernel_at_the_4b_shape():
    """24 layers of the 4B shape (conv 8192 wide, 32 x 128 x 128 states), two ragged rows."""
    convs, states = _records(24, 2, 16, 3, 8192, (32, 128, 128), mx.bfloat16, seed=2)
    keep = [3, 16]
    conv_out, state_out = cr.rollback_cuda(convs, states, mx.array(keep, dtype=mx.int32))
    for c, s, co, so in zip(convs, states, conv_out, state_out, strict=True):
        for b, n in enumerate(keep):
            assert mx.array_equal(co[b], c[b, n : n + 3]).item()
            assert mx.array_equal(so[b], s[b, n - 1]).item()


@cuda_only
def test_stats_name_both_records_one_launch_rollbacks(target):
    """``--stats`` (select.describe) says how each record is rolled back on CUDA."""
    attn = next(layer for layer in target.layers if getattr(layer, "is_linear", False)).linear_attn
    info = select.describe(attn)["gdn_record"]
    assert "states (one launch for all layers)" in info
    assert "replayed per row, every layer in one launch, kept conv rows in one launch" in info
