"""``hf2q train-draft`` end to end on tiny targets: it learns, its output loads everywhere, it resumes
exactly, and bad inputs fail with one line naming the fix.

The learning test trains on the target's own greedy continuations of a few prompts and measures
tau on those same prompts with the real DFlash decoding loop. Memorising them is the point: a
drafter only gets them accepted at inference if the training forward (anchors, positions,
context features, masks) matches the inference path exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import checkpoints as ck
import numpy as np
import pytest
from zlab_check import assert_zlab_loads_like_hf2q

from hf2q.cli.app import main
from hf2q.train import data as D
from hf2q.train.trainer import (
    Evaluated,
    Finished,
    Stage,
    StepDone,
    TrainDraftConfig,
    backend_failure,
    train_draft,
)

FAST = dict(
    layers=1,
    block_size=8,
    seq_len=48,
    batch_size=4,
    anchors_per_seq=32,
    lr=3e-3,
    init="random",
    eval_prompts=4,
    eval_prompt_tokens=16,
    eval_max_tokens=32,
    regenerate=True,
    regen_prompt_tokens=16,
)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("train_text")
    (folder / "a.txt").write_text(ck._TOKENIZER_TEXT)
    return folder


def _run(cfg: TrainDraftConfig) -> Finished:
    events = list(train_draft(cfg))
    assert isinstance(events[-1], Finished)
    return events[-1]


@pytest.fixture(scope="module")
def trained(qwen35_dir: Path, text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    out = tmp_path_factory.mktemp("runs") / "draft"
    cfg = TrainDraftConfig(
        target=str(qwen35_dir),
        data=[str(text_dir)],
        eval_data=[str(text_dir)],
        out=out,
        steps=80,
        eval_every=1000,
        **FAST,
    )
    return _run(cfg)


def test_short_training_lowers_the_loss_and_raises_tau_in_the_real_decoding_loop(trained):
    log = trained.log
    history, evals = log["history"], log["evals"]
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 80
    untrained, final = evals[0]["tau"], evals[-1]["tau"]
    assert untrained < 1.5
    assert final > untrained + 1.5, (untrained, final)
    assert log["data"]["regenerated"] and log["data"]["eval_prompts"] == 4


def test_output_is_a_z_lab_format_drafter_that_hf2q_loads_for_its_target(trained, qwen35_dir):
    import mlx.core as mx

    from hf2q.loading import load_model
    from hf2q.runtime.drafter import load_drafter
    from hf2q.runtime.target import TargetModel

    out = trained.out
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint",
        "config.json",
        "model.safetensors",
        "train_log.json",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == [2]  # one drafter layer, 4-layer target
    assert cfg["dflash_config"]["mask_token_id"] == 400  # first row past the 400-token vocabulary
    weights = mx.load(str(out / "model.safetensors"))
    assert "fc.weight" in weights and "layers.0.self_attn.q_proj.weight" in weights
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights)
    assert all(v.dtype == mx.bfloat16 for v in weights.values())
    target = TargetModel(load_model(qwen35_dir).model)
    drafter = load_drafter(out)
    drafter.config.validate_for_target(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=target.num_layers
    )


def test_training_objective_and_the_real_decoding_loop_agree_round_by_round(trained, qwen35_dir):
    """What training optimises is what inference measures, on a real (tiny) target + drafter pair.

    For every round of greedy DFlash (the loop ``hf2q generate`` runs), the training forward
    (``block_hidden`` + the target's head on full-sequence target features, anchor = the round's
    first position) must give the same block logits as the runtime drafter (chunked prefill, KV
    cache of verified context), and its count of leading correct drafts, with the target's own
    greedy tokens as labels, must equal the drafts the loop accepted.
    """
    import mlx.core as mx

    from hf2q.runtime.dflash import RoundDone, dflash_generate, make_target_cache, prefill
    from hf2q.runtime.pair import load_pair
    from hf2q.train.objective import block_hidden, make_blocks

    pair = load_pair(str(qwen35_dir), str(trained.out))
    target, drafter, tok = pair.target, pair.drafter, pair.tokenizer
    B, mask, ids = drafter.block_size, drafter.mask_token_id, drafter.config.target_layer_ids
    stream = tok.encode(ck._TOKENIZER_TEXT)
    checked = accepted = 0
    for start in (0, 48, 96):  # prompts the drafter was trained on (48-token sequences)
        prompt = stream[start : start + 16]
        events = list(dflash_generate(target, drafter, prompt, max_tokens=40))
        rounds = [e for e in events if isinstance(e, RoundDone)]
        seq = prompt + list(events[-1].tokens)
        feats = target.forward(mx.array([seq]), capture=ids)[1]  # (1, L, n_ids*H)
        a = len(prompt)  # the first round drafts after the prefill's token
        for r in rounds:
            if r.block_size < B or a + B > len(seq):
                break
            toks = np.array([seq], dtype=np.int32)
            blocks = make_blocks(
                toks, np.ones_like(toks, bool), np.array([len(seq)]),
                np.array([[a]], np.int32), np.ones((1, 1), bool), B, mask,
            )  # fmt: skip
            embeds = target.embed(mx.array(blocks.tokens.reshape(1, B)))
            trainer = target.head(block_hidden(drafter, embeds, feats, mx.array([[a]]))[:, 1:])[0]
            dcache = drafter.make_cache()
            _, ctx = prefill(target, seq[:a], make_target_cache(target), drafter=drafter,
                             draft_cache=dcache, step_size=5)  # fmt: skip
            runtime = drafter(mx.array([[seq[a]] + [mask] * (B - 1)]), ctx, dcache)[0]
            np.testing.assert_allclose(np.array(trainer), np.array(runtime), atol=2e-3, rtol=1e-3)
            right = np.array(mx.argmax(trainer, axis=-1)) == blocks.labels[0, 0]
            lead = int(np.cumprod(right).sum())
            assert lead == r.accepted, (start, a, lead, r.accepted)
            checked += 1
            accepted += r.accepted
            a += r.accepted + 1
    # The trained drafter gets many drafts accepted, so the leading counts compared are not all 0.
    assert checked >= 6 and accepted >= checked, (checked, accepted)


def test_z_labs_own_loader_reads_the_output_and_drafts_the_same_logits(
    trained, qwen35_dir, tmp_path
):
    pytest.importorskip("dflash.model_mlx")
    assert_zlab_loads_like_hf2q(qwen35_dir, trained.out, tmp_path)


def test_a_resumed_run_ends_with_the_same_weights_as_an_uninterrupted_one(
    qwen35_dir, text_dir, tmp_path
):
    import mlx.core as mx

    common = dict(FAST, regenerate=False, eval_prompts=0, steps=6, log_every=1)
    straight = _run(
        TrainDraftConfig(target=str(qwen35_dir), data=[str(text_dir)], out=tmp_path / "a", **common)
    )
    # Interrupt after the checkpoint of step 3 (the generator is simply abandoned), then resume.
    # This run computes target features per step (no feature cache); the straight one caches
    # them: the results must not differ.
    cfg = TrainDraftConfig(
        target=str(qwen35_dir),
        data=[str(text_dir)],
        out=tmp_path / "b",
        checkpoint_every=3,
        feature_cache_gb=0.0,
        **common,
    )
    for ev in train_draft(cfg):
        if isinstance(ev, StepDone) and ev.step == 4:
            break
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 3
    assert not (tmp_path / "b" / "config.json").exists()  # no final drafter yet
    cfg.resume = True
    resumed = _run(cfg)
    assert resumed.log["resumed_at"] == [3]
    assert straight.log["feature_cache_bytes"] > 0 and resumed.log["feature_cache_bytes"] == 0
    a = mx.load(str(straight.out / "model.safetensors"))
    b = mx.load(str(resumed.out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(
            np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32))
        ), k
    assert [h["loss"] for h in straight.log["history"]] == [
        h["loss"] for h in resumed.log["history"]
    ]


def test_evaluation_uses_held_out_prompts_split_from_the_data_by_default(
    qwen35_dir, text_dir, tmp_path
):
    cfg = TrainDraftConfig(
        target=str(qwen35_dir),
        data=[str(text_dir)],
        out=tmp_path / "d",
        steps=2,
        **dict(FAST, regenerate=False, eval_prompts=3),
    )
    events = list(train_draft(cfg))
    evals = [e for e in events if isinstance(e, Evaluated)]
    assert [e.step for e in evals] == [0, 2] and all(e.prompts == 3 for e in evals)
    fin = events[-1]
    all_seqs = fin.log["data"]["sequences"] + 3
    assert fin.log["data"]["eval_prompts"] == 3 and all_seqs > 3


# ---- bad inputs: one line naming the fix, non-zero exit, nothing half-written ---------------------
def _cli(args: list[str], capsys) -> tuple[int, str]:
    """Exit code and the error line; exactly one line on stderr is an error, and it is the last."""
    code = main(["train-draft", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("hf2q: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    return code, errors[0]


def _base(target: Path, data: Path, out: Path) -> list[str]:
    return ["-t", str(target), "--data", str(data), "-o", str(out), "--eval-prompts", "0"]


def test_empty_data_is_refused(qwen35_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    code, err = _cli(_base(qwen35_dir, tmp_path / "empty", tmp_path / "out"), capsys)
    assert code != 0
    assert "no training text found" in err and "pass UTF-8 text files" in err
    assert not (tmp_path / "out").exists()


def test_sequences_shorter_than_a_block_are_refused(qwen35_dir, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("def f():\n    pass\n")
    code, err = _cli(
        _base(qwen35_dir, tmp_path / "short.txt", tmp_path / "out") + ["--steps", "1"], capsys
    )
    assert code != 0
    assert "long enough for a block of 16" in err and "--block-size" in err
    assert not (tmp_path / "out").exists()  # nothing half-written is left behind


def test_malformed_jsonl_names_the_line(qwen35_dir, tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n{"text": oops}\n')
    code, err = _cli(_base(qwen35_dir, tmp_path / "d.jsonl", tmp_path / "out"), capsys)
    assert code != 0 and f"{tmp_path / 'd.jsonl'}:2 is not valid JSON" in err


def test_resuming_against_a_target_of_another_hidden_size_is_refused(
    qwen35_dir, text_dir, tmp_path, capsys
):
    out = tmp_path / "run"
    _run(
        TrainDraftConfig(
            target=str(qwen35_dir),
            data=[str(text_dir)],
            out=out,
            steps=1,
            **dict(FAST, regenerate=False, eval_prompts=0),
        )
    )
    narrow = ck.build_qwen35(tmp_path / "narrow", seed=5, hidden_size=32, intermediate_size=64)
    args = _base(narrow, text_dir, out) + ["--resume", "--block-size", "8", "--seq-len", "48"]
    code, err = _cli(args, capsys)
    assert code != 0
    assert "hidden size 64 but the target has 32" in err and "--force" in err


def test_unwritable_or_occupied_out_is_refused(qwen35_dir, text_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, err = _cli(_base(qwen35_dir, text_dir, blocker / "out"), capsys)
    assert code != 0 and "cannot write to" in err and "writable -o folder" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, err = _cli(_base(qwen35_dir, text_dir, busy), capsys)
    assert code != 0 and "--resume" in err and "--force" in err
    assert (busy / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--steps", "5", "--epochs", "1"], "either --steps or --epochs"),
        (["--block-size", "1"], "--block-size must be at least 2"),
        (["--seq-len", "10"], "cannot hold a block of 16"),
        (["--target-layer-ids", "1,x"], "comma-separated layer numbers"),
        (["--target-layer-ids", "1,9"], "outside the target's layers 0..3"),
        (["--mask-token-id", "512"], "outside the target's embedding (0..511)"),
        (["--max-minutes", "0"], "--max-minutes must be positive"),
        (["--dtype", "float8"], "--dtype must be one of auto, native"),
    ],
)
def test_bad_options_fail_with_one_line(qwen35_dir, text_dir, tmp_path, capsys, extra, needle):
    code, err = _cli(_base(qwen35_dir, text_dir, tmp_path / "out") + extra, capsys)
    assert code != 0 and needle in err, err


def test_a_time_budget_ends_training_early_and_still_writes_the_drafter(
    qwen35_dir, text_dir, tmp_path
):
    out = tmp_path / "draft"
    cfg = TrainDraftConfig(
        target=str(qwen35_dir),
        data=[str(text_dir)],
        out=out,
        steps=10_000,
        eval_every=10_000,
        max_minutes=1e-6,  # spent by the first step
        **dict(FAST, eval_prompts=1, regenerate=False),
    )
    done = _run(cfg)
    assert done.steps == 1
    log = json.loads((out / "train_log.json").read_text())
    assert log["stopped_by_time"] == {"step": 1, "planned_steps": 10_000}
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


# ---- a run's prepared (regenerated) data reused by another run -----------------------------------
def test_a_runs_regenerated_data_set_trains_another_run_as_it_is(
    trained, qwen35_dir, text_dir, tmp_path
):
    """OUT/checkpoint/dataset.npz passed as --data: no tokenizing, no second regeneration."""
    dataset = trained.out / "checkpoint" / "dataset.npz"
    seqs, _ = D.load_dataset(dataset)
    assert seqs and all(s.prompt_len == FAST["regen_prompt_tokens"] for s in seqs)
    cfg = TrainDraftConfig(
        target=str(qwen35_dir),
        data=[str(dataset)],
        eval_data=[str(text_dir)],
        out=tmp_path / "again",
        steps=2,
        **dict(FAST, eval_prompts=1),  # regenerate=True: it must not apply to a prepared set
    )
    events = list(train_draft(cfg))
    assert "regenerate" not in [e.name for e in events if isinstance(e, Stage)]
    fin = events[-1]
    assert isinstance(fin, Finished)
    assert fin.log["data"]["sequences"] == len(D.usable(seqs, FAST["block_size"]))
    again, _ = D.load_dataset(tmp_path / "again" / "checkpoint" / "dataset.npz")
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in seqs]
    assert [s.loss_mask.tolist() for s in again] == [s.loss_mask.tolist() for s in seqs]


def test_a_data_set_that_does_not_fit_the_target_or_seq_len_is_refused(
    trained, qwen35_dir, tmp_path, capsys
):
    seqs, prompts = D.load_dataset(trained.out / "checkpoint" / "dataset.npz")
    far = [D.TokenSeq(s.tokens + 10_000, s.loss_mask, s.prompt_len, s.chat) for s in seqs]
    D.save_dataset(tmp_path / "other.npz", far, prompts)
    code, err = _cli(_base(qwen35_dir, tmp_path / "other.npz", tmp_path / "o1"), capsys)
    assert code != 0 and "made for another target" in err, err
    args = _base(qwen35_dir, trained.out / "checkpoint" / "dataset.npz", tmp_path / "o2")
    code, err = _cli([*args, "--seq-len", "20", "--block-size", "8"], capsys)
    assert code != 0 and "pass --seq-len 48 or more" in err, err
    code, err = _cli(_base(qwen35_dir, tmp_path / "missing.npz", tmp_path / "o3"), capsys)
    assert code != 0 and "does not exist" in err and "dataset.npz" in err, err
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    code, err = _cli(_base(qwen35_dir, tmp_path / "bad.npz", tmp_path / "o4"), capsys)
    assert code != 0 and "cannot read" in err, err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_a_cuda_launch_failure_in_a_wide_pass_names_the_option_to_lower():
    """The error MLX 0.32.4 CUDA raised at --regen-batch 128 on the H200, as train-draft reports it."""
    from hf2q.errors import ModelError

    raw = RuntimeError(
        "cudaGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: invalid argument"
    )
    err = backend_failure(raw, "regeneration", "--regen-batch", 128)
    assert isinstance(err, ModelError)
    assert "pass a smaller --regen-batch (e.g. 64" in str(err) and "invalid argument" in str(err)
    other = RuntimeError("[matmul] Last dimension of first input with shape (1,2) must match")
    assert backend_failure(other, "the feature pass", "--batch-size", 32) is None
