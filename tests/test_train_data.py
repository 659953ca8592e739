"""Training data for ``hf2q train-draft``: reading, chat response masks, hold-out, regeneration,
batch order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf2q.errors import DataError
from hf2q.train import data as D


@pytest.fixture(scope="module")
def tok(qwen35_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(qwen35_dir)


def test_folders_text_files_and_jsonl_records_are_read_in_a_stable_order(tmp_path):
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "a.py").write_text("first = 1\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("not read")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": "raw record"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps(
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
        )
        + "\n"
    )
    recs = D.read_records([tmp_path])
    assert [r.text for r in recs[:2]] == ["first = 1\n", "second file"]
    assert recs[2].text == "raw record"
    assert recs[3].messages == [{"role": "user", "content": "hi"}]
    assert recs[4].messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    assert len(recs) == 5


def test_a_record_of_unknown_shape_names_the_accepted_keys(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match="neither 'text', 'messages' nor 'conversations'"):
        D.read_records([tmp_path / "d.jsonl"])


def test_raw_text_is_cut_into_chunks_ending_with_eos_and_all_tokens_are_responses(tok):
    text = "def add(a, b):\n    return a + b\n" * 20
    seqs = D.tokenize([D.Record("t", text=text)], tok, 32)
    ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
    assert np.concatenate([s.tokens for s in seqs]).tolist() == ids
    assert all(len(s) == 32 for s in seqs[:-1]) and all(s.loss_mask.all() for s in seqs)


def test_chat_masks_cover_exactly_the_assistant_turns(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
    (seq,) = D.tokenize([D.Record("c", messages=messages)], tok, 512)
    spans, start = [], None
    for i, m in enumerate([*seq.loss_mask.tolist(), False]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(tok.decode(seq.tokens[start:i].tolist()))
            start = None
    assert spans == ["Paris.<|im_end|>\n", "Rome.<|im_end|>\n"]
    prompt = tok.decode(seq.tokens[: seq.prompt_len].tolist())
    assert prompt.endswith("<|im_start|>assistant\n") and "Paris" not in prompt


def test_chats_without_a_usable_assistant_turn_are_refused(tok):
    with pytest.raises(DataError, match="none of the 1 chat records"):
        D.tokenize([D.Record("c", messages=[{"role": "user", "content": "hello"}])], tok, 64)


def test_held_out_prompts_leave_training_and_are_reproducible(tok):
    text = "import os\nprint(os.getcwd())\n" * 40
    seqs = D.tokenize([D.Record("t", text=text)], tok, 24)
    train, prompts = D.split_eval(seqs, 3, 8, seed=5)
    again = D.split_eval(seqs, 3, 8, seed=5)[1]
    assert prompts == again and len(prompts) == 3 and all(len(p) == 8 for p in prompts)
    assert len(train) == len(seqs) - 3


def test_eval_prompts_from_eval_data_are_the_first_n_and_none_for_zero(tok):
    text = "import os\nprint(os.getcwd())\n" * 40
    seqs = D.tokenize([D.Record("t", text=text)], tok, 24)
    assert D.eval_prompts(seqs, 0, 8) == []  # --eval-prompts 0 means no evaluation
    two = D.eval_prompts(seqs, 2, 8)
    assert two == [seqs[0].tokens[:8].tolist(), seqs[1].tokens[:8].tolist()]


def test_regeneration_keeps_prompts_and_marks_only_generated_tokens(qwen35_dir, tok):
    from hf2q.loading import load_model
    from hf2q.runtime.dflash import plain_generate, run
    from hf2q.runtime.target import TargetModel

    target = TargetModel(load_model(qwen35_dir).model)
    chat = D.tokenize(
        [
            D.Record(
                "c",
                messages=[
                    {"role": "user", "content": "Say hi"},
                    {"role": "assistant", "content": "Hi!"},
                ],
            )
        ],
        tok,
        64,
    )[0]
    raw = D.tokenize([D.Record("t", text="for i in range(10):\n    print(i)\n" * 6)], tok, 40)[0]
    gen = D.regenerate(target, [chat, raw], seq_len=40, prompt_tokens=12, eos_ids=[])
    with pytest.raises(StopIteration) as stop:
        while True:
            next(gen)
    new_chat, new_raw = stop.value.value
    assert new_chat.tokens[: chat.prompt_len].tolist() == chat.tokens[: chat.prompt_len].tolist()
    assert (
        not new_chat.loss_mask[: chat.prompt_len].any()
        and new_chat.loss_mask[chat.prompt_len :].all()
    )
    assert new_raw.tokens[:12].tolist() == raw.tokens[:12].tolist() and len(new_raw) == 40
    # The continuation is the target's own greedy decoding of the prompt.
    plain = run(plain_generate(target, raw.tokens[:12].tolist(), max_tokens=28))
    assert new_raw.tokens[12:].tolist() == plain.tokens


def test_batch_order_is_a_pure_function_of_seed_and_step():
    a = [D.batch_order(10, 3, seed=1, step=s) for s in range(9)]
    b = [D.batch_order(10, 3, seed=1, step=s) for s in range(9)]
    assert a == b
    assert sorted(sum(a[:3], [])) == sorted(set(sum(a[:3], [])))  # no repeats within an epoch
    assert a[:3] != a[3:6]  # a new permutation each epoch
