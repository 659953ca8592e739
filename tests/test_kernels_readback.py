"""A lagged round's outcome as 8-byte words (hf2q/kernels/cuda_readback.py) and its use by the rounds.

On this CPU the kernel's own source runs in the CUDA emulator (tests/cuda_emu.py): its words must
equal the ops reference's on random rounds, and reading them must give back each row's accepted
count, committed tokens (its accepted drafts, then the bonus), lookup bit and offsets. Batched
DFlash reading its rounds through the emulated kernel, lagged or synchronous, must keep plain
greedy decoding's tokens (rows finishing apart, the queue refilling them, lookup proposals chosen
on the device, drafts queued ahead), and sampled rounds must draw what they draw reading the
arrays themselves. The CUDA test runs
the real kernel.
"""

from __future__ import annotations

import cuda_emu
import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_fitted_batched_equals_plain

from hf2q.errors import UsageError
from hf2q.kernels import cuda_readback as rb
from hf2q.kernels import select
from hf2q.runtime import slots as slots_mod

HAS_CUDA = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="MLX's CUDA backend is not available")


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel's own source (emulated here, real on CUDA), its launches counted in the
    returned list; the lagged rounds are told the words apply, as they are on CUDA."""
    launches: list[tuple[int, int]] = []
    if HAS_CUDA:
        rb._launcher.cache_clear()  # compiled launches call the kernel function when traced
        real = rb._kernel

        def counted_real(rows, words):
            launches.append((rows, words))
            return real(rows, words)

        monkeypatch.setattr(rb, "_kernel", counted_real)
        return launches
    if cuda_emu.compiler() is None:
        pytest.skip("no C++ compiler for the CUDA emulator")
    built: dict[tuple[int, int], cuda_emu.EmulatedKernel] = {}

    def emulated(rows: int, words: int):
        if (rows, words) not in built:
            name, ins, outs, src = rb.spec(rows, words)
            built[rows, words] = cuda_emu.EmulatedKernel(name, ins, outs, src, workdir=tmp_path)
        launches.append((rows, words))
        return built[rows, words]

    monkeypatch.setattr(rb, "_kernel", emulated)
    monkeypatch.setattr(slots_mod, "round_words_enabled", lambda: True)
    return launches


def _round(rng, R, B, V, lookup=True, offsets=2):
    draft = mx.array(rng.integers(0, V, (R, B - 1)), dtype=mx.int32)
    acc = mx.array(rng.integers(0, B, (R,)), dtype=mx.int32)
    bonus = mx.array(rng.integers(0, V, (R,)), dtype=mx.int32)
    use = mx.array(rng.integers(0, 2, (R,)).astype(bool)) if lookup else None
    offs = [mx.array(rng.integers(0, rb.MAX_OFFSET + 1, (R,)), dtype=mx.int32)]
    offs += [mx.array(rng.integers(0, 5000, (R,)), dtype=mx.int32)]
    return rb.RoundArrays(draft, acc, bonus, use, offs[:offsets])


@pytest.mark.parametrize(
    "R,B,V,lookup,offsets",
    [
        (1, 16, 248320, False, 1),
        (4, 16, 248320, True, 2),
        (8, 16, 1000, True, 0),
        (3, 5, 2**20, False, 2),
        (32, 32, 151936, True, 2),
    ],
)
def test_the_kernels_words_equal_the_ops_reference_and_read_back(kernel, R, B, V, lookup, offsets):
    rng = np.random.default_rng(R * 1000 + B)
    lay = rb.layout(V, B)
    rnd = _round(rng, R, B, V, lookup, offsets)
    draft, acc, bonus, use, offs = rnd
    assert rb.supported(draft, lay, len(offs), 0) is None
    words = rb.pack_round(rnd, lay)
    assert len(kernel) == 1  # every row's words in one launch
    assert len(words) == R and all(len(w) == lay.words for w in words)
    assert all(x.shape == (1,) and x.dtype == mx.int64 and x.nbytes == 8 for w in words for x in w)
    got = np.array([[int(x.item()) for x in w] for w in words])
    assert (got == np.array(rb.pack_round_ops(rnd, lay))).all()

    busy = [r % 3 != 2 for r in range(R)]  # a row not read has only its word 0 read
    out = rb.read_round(words, busy, lay)
    d, a, b = np.array(draft), np.array(acc), np.array(bonus)
    o = [np.array(x) for x in offs] + [np.zeros(R, np.int64)] * (2 - len(offs))
    u = np.array(use) if use is not None else np.zeros(R, bool)
    for r, row in enumerate(out):
        assert row.accepted == a[r] and row.looked_up == bool(u[r])
        assert row.offsets == (o[0][r], o[1][r])
        assert row.committed == ([*d[r, : a[r]].tolist(), int(b[r])] if busy[r] else [])


def test_the_layout_fits_each_rows_block():
    assert rb.layout(248320, 16) == rb.Layout(bits=18, per=3, words=7, block=16)  # Qwen3.5
    assert rb.layout(151936, 16).bits == 18
    assert rb.layout(1000, 16) == rb.Layout(bits=10, per=6, words=4, block=16)
    for V in (2, 17, 2**18, 2**18 + 1, 2**31):
        for B in (2, 5, 16, 32):
            lay = rb.layout(V, B)
            assert 2**lay.bits > V - 1 and lay.per * lay.bits <= 63
            assert (lay.words - 1) * lay.per >= B  # a full block's a + 1 = B tokens fit


def test_supported_names_what_does_not_fit():
    lay = rb.layout(1000, 16)
    d = mx.zeros((2, 15), dtype=mx.int32)
    assert rb.supported(d, lay, 2, rb.MAX_OFFSET) is None
    assert "block of 33" in rb.supported(mx.zeros((2, 32), dtype=mx.int32), rb.layout(1000, 33))
    assert "33 rows" in rb.supported(mx.zeros((33, 15), dtype=mx.int32), lay)
    assert "3 distinct" in rb.supported(d, lay, 3)
    assert "offsets up to" in rb.supported(d, lay, 1, rb.MAX_OFFSET + 1)
    assert "32 bits" in rb.supported(d, rb.layout(2**32, 16))


def test_the_switch_is_read_and_checked(monkeypatch):
    monkeypatch.setenv(select.ROUND_WORDS_ENV, "maybe")
    with pytest.raises(UsageError, match="HF2Q_ROUND_WORDS"):
        select.round_words_enabled()
    monkeypatch.setenv(select.ROUND_WORDS_ENV, "0")
    assert not select.round_words_enabled()
    assert "8-byte words" not in select.summary()  # what --stats reports
    monkeypatch.delenv(select.ROUND_WORDS_ENV)
    on_cuda = select.backend() == "cuda"
    assert select.round_words_enabled() == on_cuda
    assert ("round outcomes read as 8-byte words" in select.summary()) == on_cuda
    monkeypatch.setattr(select, "backend", lambda: "cuda")  # what --stats says on CUDA
    assert "round outcomes read as 8-byte words" in select.summary()
    assert "small host-made arrays joined from 8-byte pieces" in select.summary()
    monkeypatch.setenv(select.HOST_PIECES_ENV, "0")
    assert "8-byte pieces" not in select.summary()


@pytest.mark.parametrize("lagged", [True, False], ids=["lagged", "synchronous"])
@pytest.mark.parametrize("slots,block", [(1, 16), (3, 4), (2, 7)])
def test_rounds_read_as_words_equal_plain(kernel, fitted_pairs, slots, block, lagged):
    # Rows finishing at different times and the queue refilling them (the batch compacted);
    # lagged rounds also read the target's and the drafter's attention offsets from word 0.
    assert_fitted_batched_equals_plain(fitted_pairs, lagged=lagged, slots=slots, block=block)
    assert kernel  # the rounds were read through the kernel's words


def _demo_queue(lengths):
    from hf2q.runtime.bench import BUILTIN_PROMPTS
    from hf2q.runtime.pair import encode_prompt, load_pair
    from hf2q.runtime.slots import Request

    pair = load_pair(None, None)
    prompts = [
        encode_prompt(pair.tokenizer, p, chat=False) for p in BUILTIN_PROMPTS[: len(lengths)]
    ]
    reqs = [Request(p, max_tokens=m) for p, m in zip(prompts, lengths, strict=True)]
    return pair, prompts, reqs


@pytest.mark.parametrize(
    "options",
    [
        {"lagged": True, "device_lookup": True},  # the rows' lookup choices in word 0
        {"lagged": False, "draft_ahead": True},  # read while the next draft runs
    ],
    ids=["lagged-device-lookup", "synchronous-draft-ahead"],
)
def test_lookup_rounds_read_as_words_keep_plain_greedy_tokens(kernel, options):
    # Every request keeps plain greedy decoding's tokens; lookup and the drafter both draft.
    from hf2q.runtime.dflash import plain_generate, run
    from hf2q.runtime.slots import SlotRound, slots_dflash_generate

    lengths = [48, 31, 48, 17]
    pair, prompts, reqs = _demo_queue(lengths)
    want = [
        run(plain_generate(pair.target, p, max_tokens=m)).tokens
        for p, m in zip(prompts, lengths, strict=True)
    ]
    events = list(
        slots_dflash_generate(
            pair.target, pair.drafter, reqs, slots=3, block_size=16, lookup=True, **options
        )
    )
    assert [r.tokens for r in events[-1].requests] == want
    sources = [s for e in events if isinstance(e, SlotRound) for s in e.sources]
    assert "lookup" in sources and "drafter" in sources
    assert kernel


@pytest.mark.parametrize("lagged", [True, False], ids=["lagged", "synchronous"])
def test_sampled_rounds_draw_the_same_tokens_read_as_words(kernel, monkeypatch, lagged):
    # T > 0: the words carry the drafts and the bonus each row drew on the device; read as
    # words or as arrays, the same seed gives the same tokens.
    from hf2q.runtime.sampling import SamplingParams
    from hf2q.runtime.slots import slots_dflash_generate

    out = {}
    for words in (True, False):
        monkeypatch.setattr(slots_mod, "round_words_enabled", lambda w=words: w)
        n = len(kernel)
        pair, _, reqs = _demo_queue([24, 13, 19])
        events = list(
            slots_dflash_generate(
                pair.target,
                pair.drafter,
                reqs,
                slots=2,
                block_size=8,
                lagged=lagged,
                sampling=SamplingParams(temperature=0.8, seed=11),
            )
        )
        out[words] = [r.tokens for r in events[-1].requests]
        assert (len(kernel) > n) == words
    assert out[True] == out[False]


@pytest.mark.parametrize("idle", ["compact", "keep"])
def test_plain_batched_steps_read_as_words_equal_single_runs(
    kernel, fitted_pairs, monkeypatch, idle
):
    # From 3 rows a plain step's tokens are more than 8 bytes: they are read as words. Rows
    # finishing apart and the queue refilling them (a new row's first token written into the
    # step's input after its words were made), compacted or kept; greedy equals each prompt's
    # own run, sampled draws what reading the array draws.
    from conftest import FIT_TEXTS, load_fitted

    from hf2q.runtime.dflash import plain_generate, run
    from hf2q.runtime.sampling import SamplingParams
    from hf2q.runtime.slots import Request, run_slots, slots_plain_generate

    lm, target, _ = load_fitted(*fitted_pairs["qwen35"])
    eos = lm.tokenizer.eos_token_ids
    prompts = [lm.tokenizer.encode(t) for t in FIT_TEXTS[:5]]
    lengths = [18, 30, 9, 24, 14]
    want = [
        run(plain_generate(target, p, max_tokens=n, eos_token_ids=eos)).tokens
        for p, n in zip(prompts, lengths, strict=True)
    ]

    def batched(sampling=None):
        reqs = [Request(p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        events = slots_plain_generate(
            target, reqs, slots=3, sampling=sampling, eos_token_ids=eos, idle=idle
        )
        return [s.tokens for s in run_slots(events).requests]

    assert batched() == want
    assert kernel  # the steps were read through the kernel's words
    sampled = {}
    for words in (True, False):
        monkeypatch.setattr(slots_mod, "round_words_enabled", lambda w=words: w)
        sampled[words] = batched(SamplingParams(temperature=0.8, seed=7))
    assert sampled[True] == sampled[False]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 8, 9, 32, 33])
def test_host_ints_from_pieces_hold_the_values(monkeypatch, n):
    vals = [(-1) ** i * (7 * i + 3) for i in range(n)]
    for on in ("1", "0"):
        monkeypatch.setenv(select.HOST_PIECES_ENV, on)
        got = rb.host_ints(vals)
        assert got.dtype == mx.int32 and got.shape == (n,) and got.tolist() == vals
    monkeypatch.setenv(select.HOST_PIECES_ENV, "maybe")
    with pytest.raises(UsageError, match="HF2Q_HOST_PIECES"):
        rb.host_ints([1, 2, 3])


@pytest.mark.parametrize("lagged", [True, False], ids=["lagged", "synchronous"])
def test_rounds_with_host_arrays_from_pieces_equal_plain(fitted_pairs, monkeypatch, lagged):
    # Last tokens, kept counts, offsets and draft limits of 3 rows joined from 8-byte pieces.
    monkeypatch.setenv(select.HOST_PIECES_ENV, "1")
    assert_fitted_batched_equals_plain(fitted_pairs, lagged=lagged, slots=3, block=5)


@cuda_only
def test_round_words_on_the_gpu(kernel):  # pragma: no cover - CUDA only
    rng = np.random.default_rng(3)
    lay = rb.layout(248320, 16)
    rnd = _round(rng, 8, 16, 248320)
    got = np.array([[int(x.item()) for x in w] for w in rb.pack_round(rnd, lay)])
    assert (got == np.array(rb.pack_round_ops(rnd, lay))).all()
