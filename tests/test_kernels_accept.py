"""Greedy acceptance in one launch (hf2q/kernels/cuda_accept.py) and the rounds that use it.

On this CPU the kernel's source runs in the CUDA emulator (tests/cuda_emu.py); on CUDA the real
kernel. Its values are integers: they must equal the ops (``accept_greedy``, then ``a + 1``).
"""

from __future__ import annotations

import cuda_emu
import mlx.core as mx
import numpy as np
import pytest
from conftest import HAS_CUDA, assert_fitted_batched_equals_plain

from hf2q.errors import UsageError
from hf2q.kernels import cuda_accept as ca
from hf2q.kernels import select
from hf2q.runtime import slots as slots_mod
from hf2q.runtime.sampling import accept_greedy


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel's own source (emulated here, real on CUDA), its launches counted in the
    returned list; rounds are told the switch is on, as ``HF2Q_ACCEPT_KERNEL=1`` does on CUDA."""
    launches: list[int] = []
    if HAS_CUDA:
        ca._launcher.cache_clear()  # a compiled launch calls the kernel function when traced
        real = ca._kernel
    else:
        if cuda_emu.compiler() is None:
            pytest.skip("no C++ compiler for the CUDA emulator")
        emu = cuda_emu.EmulatedKernel(
            "hf2q_accept_greedy",
            ["draft", "choice", "limit"],
            ["accepted", "bonus", "keep", "block"],
            ca._SOURCE,
            workdir=tmp_path,
        )

        def real():
            return emu

    def counted():
        launches.append(1)
        return real()

    ca._launcher.cache_clear()  # (a kept launcher holds the kernel it was traced with)

    monkeypatch.setattr(ca, "_kernel", counted)
    monkeypatch.setattr(slots_mod, "accept_kernel_enabled", lambda: True)
    return launches


def _case(rng, R: int, n: int, agree: float):
    """Drafts (R, n), the target's argmax (R, n+1) agreeing with each draft with probability
    ``agree``, and limits (R,) between 0 and n."""
    choice = rng.integers(0, 50, size=(R, n + 1))
    draft = np.where(rng.random((R, n)) < agree, choice[:, :n], rng.integers(0, 50, size=(R, n)))
    limit = rng.integers(0, n + 1, size=R)
    limit[0] = n  # (one row may take every draft)
    return draft, choice, limit


@pytest.mark.parametrize("R,n", [(1, 15), (3, 4), (4, 15), (8, 7), (40, 3)])
@pytest.mark.parametrize("agree", [0.0, 0.8, 1.0])
def test_one_launch_gives_the_ops_acceptance(kernel, R, n, agree):
    rng = np.random.default_rng(R * 100 + n + int(agree * 10))
    draft, choice, limit = _case(rng, R, n, agree)
    d = mx.array(draft, dtype=mx.int32)
    c = mx.array(choice, dtype=mx.uint32)  # as mx.argmax gives it
    lim = mx.array(limit, dtype=mx.int32)
    a, bonus, keep, block = ca.accept_greedy_cuda(d, c, lim, 9999)
    want_a, want_bonus = accept_greedy(d, c.astype(mx.int32), lim)
    assert a.dtype == bonus.dtype == keep.dtype == mx.int32
    assert a.tolist() == want_a.tolist() and bonus.tolist() == want_bonus.tolist()
    assert keep.tolist() == [v + 1 for v in want_a.tolist()]
    # the drafter's next blocks: the bonus token, then the mask token
    assert block.tolist() == [[b] + [9999] * n for b in want_bonus.tolist()]
    assert kernel


def test_shapes_that_do_not_fit_are_refused():
    d = mx.zeros((2, 4), dtype=mx.int32)
    with pytest.raises(ValueError, match="choices"):
        ca.accept_greedy_cuda(d, mx.zeros((2, 4), dtype=mx.uint32), mx.zeros((2,), mx.int32), 0)
    with pytest.raises(ValueError, match="limits"):
        ca.accept_greedy_cuda(d, mx.zeros((2, 5), dtype=mx.uint32), mx.zeros((3,), mx.int32), 0)


def test_the_switch_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(select.ACCEPT_KERNEL_ENV, raising=False)
    assert not select.accept_kernel_enabled()
    monkeypatch.setenv(select.ACCEPT_KERNEL_ENV, "1")
    assert select.accept_kernel_enabled() == (select.backend() == "cuda")
    monkeypatch.setenv(select.ACCEPT_KERNEL_ENV, "yes")
    with pytest.raises(UsageError, match="HF2Q_ACCEPT_KERNEL"):
        select.accept_kernel_enabled()


@pytest.mark.parametrize("lagged", [True, False], ids=["lagged", "synchronous"])
@pytest.mark.parametrize("slots,block", [(1, 16), (3, 4)])
def test_rounds_accepting_in_one_launch_equal_plain(kernel, fitted_pairs, slots, block, lagged):
    # Greedy batched DFlash with the launch deciding every round (rows finishing at different
    # times, the queue refilling them, the batch compacted) gives each prompt's plain tokens.
    assert_fitted_batched_equals_plain(fitted_pairs, lagged=lagged, slots=slots, block=block)
    assert kernel  # the rounds accepted through the launch
