"""``--draft-head-bits``: drafts read a 4- or 8-bit copy of the target's head, the output does not
change.

Greedy DFlash with the quantized draft head gives plain greedy decoding's tokens (one sequence and
batched slots), on a fitted untied pair and on the tied demo pair; sampled DFlash still follows the
target's distribution; the copy follows a dtype cast; bad values fail before anything loads.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIT_TEXTS, assert_greedy_dflash_equals_plain, load_fitted

from hf2q.errors import ModelError
from hf2q.runtime.dflash import RoundDone, dflash_generate, run


@pytest.fixture(scope="module")
def fitted(fitted_pairs):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    prompts = [lm.tokenizer.encode(t)[:n] for t, n in zip(FIT_TEXTS[:3], (5, 9, 3), strict=True)]
    return target, drafter, prompts


def _draft_logits(target, head, seed: int = 3) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    h = mx.random.normal((1, 15, target.hidden_size)).astype(target.dtype)
    got = head(h)  # a draft vocabulary's: its ids' columns, widened as a sampled draft does
    widen = getattr(head, "widen", None)
    return got if widen is None else widen(got), target.head(h)


def _assert_greedy_equal_with(head, target, drafter, prompts) -> None:
    """Greedy DFlash with the drafter bound to ``head`` gives plain decoding's tokens (blocks 4
    and 16, then two slots)."""
    drafter.bind(target.embed, head)
    try:
        assert_greedy_dflash_equals_plain(
            target, drafter, prompts, [24, 17, 30], blocks=(4, 16), slots=2
        )
    finally:
        drafter.bind(target.embed, target.head)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_draft_head_keeps_greedy_dflash_equal_to_plain(fitted, bits):
    target, drafter, prompts = fitted
    head = target.draft_head(bits)
    got, full = _draft_logits(target, head)
    # the copy is read on every device: its groups avoid MLX's CUDA product of one-group rows
    # (target.copy_group), which an H100 got wrong for this pair's hidden 64 (sessions 51, 54)
    assert (bits, 0) not in target.draft_head_notes, target.draft_head_notes
    # a real copy: other logits, close to the head's (what the drafts propose from)
    assert not mx.array_equal(got, full)
    err = float(mx.abs(got - full).max()) / float(mx.abs(full).max())
    assert err < (0.15 if bits == 4 else 0.02), err
    assert target.draft_head(bits) is head  # made once a bit width
    _assert_greedy_equal_with(head, target, drafter, prompts)


@pytest.mark.parametrize("bits", [4, 8])
def test_drafts_of_more_rows_than_the_heads_kernel_takes_read_the_head_itself(
    fitted, bits, monkeypatch
):
    # Four slots' drafts (60 rows): the copies' products were slower than the bf16 head's there
    # (session 50), so beyond select.draft_head_mm_rows() the draft head is the head itself.
    from hf2q.kernels import select

    target, _, _ = fitted
    head = target.draft_head(bits)
    mx.random.seed(7)
    h = mx.random.normal((4, 15, target.hidden_size)).astype(target.dtype)
    assert select.draft_head_mm_rows() == 32
    assert mx.array_equal(head(h), target.head(h))  # 60 rows
    assert not mx.array_equal(head(h[:2]), target.head(h[:2]))  # 30 rows: the copy
    monkeypatch.setenv(select.DRAFT_HEAD_MM_ROWS_ENV, "8")
    assert mx.array_equal(head(h[:1]), target.head(h[:1]))  # 15 rows
    assert not mx.array_equal(head(h[:1, :8]), target.head(h[:1, :8]))


def test_quantized_draft_head_proposes_what_the_full_head_proposes_on_the_demo_pair():
    # The tied demo pair (a drafter trained on its target): the 8-bit draft head accepts about
    # as many tokens a round as the head itself, and the tokens are plain decoding's.
    from hf2q.runtime.dflash import plain_generate
    from hf2q.runtime.pair import apply_dtype, encode_prompt, load_pair

    full = load_pair(None)
    pair = load_pair(None, draft_head_bits=8)
    assert pair.target.args.tie_word_embeddings
    apply_dtype(full.target, full.drafter, "float32")
    apply_dtype(pair.target, pair.drafter, "float32")
    ids = encode_prompt(pair.tokenizer, pair.default_prompt, chat=pair.chat_default)
    # the copy followed the cast (from the pair's bf16) before any draft read it
    (weight,), q = pair.target.inner.embed_tokens._hf2q_draft_head_8  # (small_mm.kept's entry)
    assert weight is pair.target.inner.embed_tokens.weight and q.scales.dtype == pair.target.dtype
    want = run(plain_generate(pair.target, ids, max_tokens=48)).tokens
    taus = {}
    for name, p in (("full", full), ("8-bit", pair)):
        events = list(dflash_generate(p.target, p.drafter, ids, max_tokens=48, lookup=False))
        rounds = [e for e in events if isinstance(e, RoundDone)]
        taus[name] = np.mean([len(r.committed) for r in rounds])
        assert events[-1].tokens == want, name
    assert taus["8-bit"] >= 0.8 * taus["full"], taus


@pytest.mark.parametrize(("bits", "vocab"), [(4, 0), (0, 60)])
def test_sampled_dflash_with_a_quantized_or_cut_draft_head_follows_the_target(fitted, bits, vocab):
    # Rejection sampling takes the draft's own probabilities: a 4-bit head's q changes how often
    # drafts are kept, not what is committed; with a draft vocabulary q is 0 outside its ids (a
    # target token there only comes from the residual). Chi-square against the target's exact
    # joint.
    from test_runtime_sampling import BLOCK, N_RUNS, _chi2_pvalue, _draws, _exact_joint

    target, drafter, prompts = fitted
    prompt = prompts[0][:4]
    exact = _exact_joint(target, prompt, 3)
    drafter.bind(target.embed, target.draft_head(bits, vocab))
    try:
        dfl = _draws(
            lambda sp: dflash_generate(
                target, drafter, prompt, max_tokens=32, block_size=BLOCK, sampling=sp
            )
        )
    finally:
        drafter.bind(target.embed, target.head)
    assert _chi2_pvalue(dfl, exact, N_RUNS) > 1e-3


def test_draft_head_bits_are_checked(fitted):
    target, _, _ = fitted
    assert target.draft_head(0) == target.head
    with pytest.raises(ModelError, match="4 or 8 bits, not 6: pass 4 or 8"):
        target.draft_head(6)


def test_a_copys_rows_are_never_one_group_of_64(fitted):
    # MLX's CUDA quantized product of several rows was wrong where a row was one group of 64
    # (hidden 64, session 54; every dtype and width in session 55): copies of heads that narrow
    # take groups of 32. One group of 32 (hidden 32) was right on the same GPU (session 55).
    from hf2q.runtime.target import copy_group

    assert [copy_group(h) for h in (32, 64, 96, 128, 1024, 2560)] == [32, 32, 32, 64, 64, 64]
    target, _, _ = fitted
    assert target.hidden_size == 64
    assert target._copy(4, 0).group_size == 32 and target._copy(8, 100).group_size == 32


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--draft-head-bits=5", "--draft-head-bits must be 0, 4 or 8, got 5"),
        (
            "--draft-vocab=-3",
            "--draft-vocab must be 0 (the whole vocabulary) or a token count, got -3",
        ),
    ],
)
def test_cli_rejects_bad_draft_head_options_before_loading(capsys, command, option, message):
    from hf2q.cli.app import main

    assert main([command, option]) != 0
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_generate_reports_the_draft_head_it_ran(capsys, monkeypatch):
    from hf2q.cli.app import main

    monkeypatch.setenv("HF2Q_DRAFT_HEAD_BITS", "8")
    assert main(["generate", "def add(a, b):", "-n", "12", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["draft_head_bits"] == 8


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_frozen_quantized_products_take_all_slots_rows_at_once(kind):
    # A draft's quantized head / layer off the kernel (FROZEN) joins the slots' rows into one
    # product (MLX's CUDA product runs a 3-D input as one GEMM a slot); same values, same shape.
    import mlx.nn as nn

    from hf2q.kernels import linear as small_mm

    mx.random.seed(5)
    if kind == "linear":
        mod = nn.QuantizedLinear.from_linear(nn.Linear(128, 96, bias=False), 64, 4)
        call = small_mm.linear
    else:
        mod = nn.QuantizedEmbedding.from_embedding(nn.Embedding(96, 128), 64, 4)
        call = small_mm.head
    x = mx.random.normal((3, 5, 128))
    got = call(mod, x, small_mm.FROZEN)
    want = mod(x) if kind == "linear" else mod.as_linear(x)
    assert got.shape == (3, 5, 96)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5)


# -- a draft vocabulary (--draft-vocab) -----------------------------------------------------------


@pytest.mark.parametrize("bits", [0, 4])
def test_a_draft_vocabulary_keeps_greedy_dflash_equal_to_plain(fitted, bits):
    # The fitted pair's 512-token vocabulary cut to 128 ids (4-bit rows too): drafts propose
    # from those only, the tokens are still plain decoding's, alone and on two slots.
    target, drafter, prompts = fitted
    head = target.draft_head(bits, 100)
    assert target.draft_head(bits, 100) is head  # made once
    _assert_greedy_equal_with(head, target, drafter, prompts)


def test_a_draft_vocabularys_logits_are_the_heads_at_its_ids_and_minus_inf_elsewhere(fitted):
    target, _, _ = fitted
    ids = target.draft_vocab_ids(100)
    # 100 lowest ids, the tokenizer's special / stop tokens, more low ids up to 128 rows
    special = {int(i) for i in target.tokenizer.eos_token_ids}
    assert len(ids) == 128 and ids == sorted(set(ids))
    assert set(range(100)) <= set(ids) and special <= set(ids)
    got, full = _draft_logits(target, target.draft_head(0, 100))
    inside = mx.array(ids)
    assert got.shape == full.shape
    assert mx.allclose(got[..., inside], full[..., inside], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(target.vocab_size), ids)
    assert np.all(np.array(got[..., mx.array(outside)]) == -np.inf)
    # 4-bit rows: close to the head's there, -inf elsewhere too
    got4, _ = _draft_logits(target, target.draft_head(4, 100))
    err = float(mx.abs(got4[..., inside] - full[..., inside]).max())
    assert (4, 100) not in target.draft_head_notes, target.draft_head_notes
    assert 0 < err < 0.15 * float(mx.abs(full).max())
    assert np.all(np.array(got4[..., mx.array(outside)]) == -np.inf)
    # a vocabulary as large as the head's is the head itself
    assert target.draft_head(0, target.vocab_size) == target.head
    with pytest.raises(ModelError, match="pass 0 for the whole one"):
        target.draft_head(0, -1)


def test_a_draft_vocabularys_greedy_drafts_map_its_columns_to_token_ids(fitted):
    # A greedy draft takes the argmax of the ids' columns and maps it (no widening, whose gather
    # cost more than the rows' product on an H100); a sampled draft widens first.
    target, drafter, _ = fitted
    head = target.draft_head(0, 100)
    mx.random.seed(5)
    h = mx.random.normal((2, 15, target.hidden_size)).astype(target.dtype)
    raw = head(h)
    assert raw.shape == (2, 15, 128)
    drafter.bind(target.embed, head)
    try:
        got = drafter.proposals(raw)
        wide = drafter.full_logits(raw)
        assert wide.shape == (2, 15, target.vocab_size)
        assert mx.array_equal(got, mx.argmax(wide, axis=-1).astype(mx.int32))
        assert set(np.array(got).ravel().tolist()) <= set(target.draft_vocab_ids(100))
    finally:
        drafter.bind(target.embed, target.head)
    full = target.head(h)  # the whole head: column j is token j, nothing widened
    assert mx.array_equal(drafter.proposals(full), mx.argmax(full, axis=-1).astype(mx.int32))
    assert drafter.full_logits(full) is full


def test_a_draft_vocabulary_keeps_special_and_stop_tokens_in_whole_blocks_of_rows(
    fitted, monkeypatch
):
    class Tokenizer:  # what draft_vocab_ids reads of mlx-lm's wrapper / a transformers tokenizer
        eos_token_ids = [100, 300]

        def get_added_vocab(self):
            return {"<|im_end|>": 101, "<think>": 511}

    target, _, _ = fitted
    monkeypatch.setattr(target, "tokenizer", Tokenizer())
    ids = target.draft_vocab_ids(100)
    assert len(ids) == len(set(ids)) == 128 and ids == sorted(ids)
    assert {100, 101, 300, 511} <= set(ids) and set(range(100)) <= set(ids)
    assert len(target.draft_vocab_ids(400)) == 512  # rounded up to all rows: every id once
    assert target.draft_head(0, 400) == target.head  # so the head itself


def test_a_draft_vocabulary_of_a_quantized_head_keeps_its_rows_quantized(fitted_pairs):
    import mlx.nn as nn

    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    nn.quantize(lm.model, group_size=32, bits=8)
    head = target.draft_head(4, 100)  # bits do not apply to a quantized head
    rows = target._vocab_rows(100)
    assert type(rows) is nn.QuantizedLinear and rows.bits == 8 and rows.weight.shape[0] == 128
    got, full = _draft_logits(target, head)
    inside = mx.array(target.draft_vocab_ids(100))
    assert mx.allclose(got[..., inside], full[..., inside], rtol=1e-4, atol=1e-4)
    prompts = [lm.tokenizer.encode(t)[:n] for t, n in zip(FIT_TEXTS[:2], (5, 9), strict=True)]
    drafter.bind(target.embed, head)
    assert_greedy_dflash_equals_plain(target, drafter, prompts, [20, 12], blocks=(16,), slots=2)


def test_generate_reports_the_draft_vocabulary_it_ran(capsys):
    from hf2q.cli.app import main

    assert main(["generate", "def add(a, b):", "-n", "12", "--json", "--draft-vocab", "2048"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["draft_vocab"] == 2048


# -- a copy whose product is wrong on the device ---------------------------------------------------


def _zero_quantized_products(monkeypatch):
    """MLX's quantized product giving zeros, as it gave about zero for the fitted pair's float32
    4-bit copy on an H100 (session 51)."""
    real = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: mx.zeros_like(real(x, *a, **k)))


@pytest.mark.parametrize("vocab", [0, 100])
def test_a_copy_whose_logits_are_far_off_is_not_read_and_says_why(fitted_pairs, monkeypatch, vocab):
    lm, target, drafter = load_fitted(*fitted_pairs["qwen35"])
    _zero_quantized_products(monkeypatch)
    head = target.draft_head(4, vocab)
    assert "4-bit copy gave logits 100% of the largest off" in target.draft_head_notes[(4, vocab)]
    assert "drop --draft-head-bits" in target.draft_head_notes[(4, vocab)]
    got, full = _draft_logits(target, head)
    if vocab:  # the vocabulary's unquantized rows
        inside = mx.array(target.draft_vocab_ids(vocab))
        assert mx.allclose(got[..., inside], full[..., inside], rtol=1e-5, atol=1e-5)
    else:
        assert mx.array_equal(got, full)
    monkeypatch.undo()  # the product right again, the weights cast: checked again, read again
    target.model.set_dtype(mx.float16)
    target.refresh_draft_heads()
    assert target.draft_head_notes == {}
    got, full = _draft_logits(target, head)
    assert not mx.array_equal(got, full)


def test_generate_says_when_the_draft_heads_copy_is_not_read(capsys, monkeypatch):
    from hf2q.cli.app import main

    _zero_quantized_products(monkeypatch)
    assert main(["generate", "def add(a, b):", "-n", "8", "--draft-head-bits", "8"]) == 0
    assert "draft head's 8-bit copy gave logits" in capsys.readouterr().err
    assert main(["generate", "def add(a, b):", "-n", "8", "--draft-head-bits", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "drop --draft-head-bits" in record["draft_head_notes"][0]
