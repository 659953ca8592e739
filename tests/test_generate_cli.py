"""``hf2q generate``: JSON and plain output, prompt sources, the demo/registry lookup, bad inputs,
and the decision to preload a fast BLAS."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import checkpoints as ck
import pytest
from conftest import generate_json, run_generate

from hf2q.platform import BlasPlan, plan_blas

PROMPT = "def add(a, b):"


def test_json_has_the_documented_keys_and_dflash_equals_plain(capsys, qwen35_dir, drafter_dir):
    base = [PROMPT, "-m", str(qwen35_dir), "--no-chat", "-n", "12"]
    dfl = generate_json(capsys, *base, "-d", str(drafter_dir), "-b", "5")
    for key in (
        "tokens",
        "text",
        "rounds",
        "tau",
        "acceptance_rate",
        "accepted_histogram",
        "prompt_tps",
        "generation_tps",
        "peak_memory_gb",
        "blas",
        "blas_kind",
        "kernels",
    ):
        assert key in dfl, key
    # On this CPU: portable ops, exact-length attention keys (the CUDA choices are H200-tested).
    assert dfl["kernels"].startswith("cpu; Gated-DeltaNet ops") and "exact length" in dfl["kernels"]
    assert dfl["mode"] == "dflash" and len(dfl["tokens"]) == 12 and dfl["block_size"] == 5
    assert len(dfl["accepted_histogram"]) == 5 and sum(dfl["accepted_histogram"]) == dfl["rounds"]
    plain = generate_json(capsys, *base, "--no-dflash")
    assert plain["mode"] == "plain" and plain["tokens"] == dfl["tokens"]
    assert plain["text"] == dfl["text"]
    assert "tau" not in plain and "rounds" not in plain
    assert plain["generation_tps"] > 0 and plain["peak_memory_gb"] >= 0


def test_plain_output_streams_text_to_stdout_and_stats_to_stderr(capsys, qwen35_dir, drafter_dir):
    pair = (PROMPT, "-m", str(qwen35_dir), "-d", str(drafter_dir), "--no-chat", "-n", "6")
    code, out, err = run_generate(capsys, *pair, "-b", "3")
    assert code == 0
    text = generate_json(capsys, *pair, "-b", "3")["text"]
    assert out == text + "\n"
    assert "round 1: drafted 2 accepted" in err
    assert "tau (mean a+1):" in err and "accepted histogram: 0:" in err
    code, out, err = run_generate(capsys, *pair, "--no-stats")
    assert code == 0 and "round" not in err and out == text + "\n"


def test_prompt_comes_from_file_or_stdin(capsys, qwen35_dir, tmp_path, monkeypatch):
    args = ["-m", str(qwen35_dir), "--no-dflash", "-n", "5"]
    want = generate_json(capsys, PROMPT, *args)["tokens"]
    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT)
    assert generate_json(capsys, "--prompt-file", str(f), *args)["tokens"] == want
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    assert generate_json(capsys, *args)["tokens"] == want


def test_chat_template_and_thinking_switch_change_the_prompt(capsys, qwen35_dir):
    args = ["hi", "-m", str(qwen35_dir), "--no-dflash", "-n", "1"]
    raw = generate_json(capsys, *args, "--no-chat")["prompt_tokens"]
    chat = generate_json(capsys, *args)["prompt_tokens"]
    no_think = generate_json(capsys, *args, "--no-thinking")["prompt_tokens"]
    assert raw < chat < no_think  # template turns, then the empty think block


def _one_line_error(capsys, *args: str) -> str:
    code, _, err = run_generate(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("hf2q: error:"), err
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["-n", "0"], "--max-tokens must be at least 1"),
        (["-b", "1"], "--block-size must be auto or a whole number from 2"),
        (["-b", "17"], "above the drafter's block size 16"),
        (["--temp", "-0.5"], "--temp must be 0 (greedy) or positive"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-k", "-2"], "--top-k must be 0 (off) or positive"),
        (["--no-dflash", "-b", "4"], "--block-size applies to DFlash only"),
    ],
)
def test_bad_options_are_one_line_errors(capsys, qwen35_dir, drafter_dir, extra, needle):
    msg = _one_line_error(capsys, PROMPT, "-m", str(qwen35_dir), "-d", str(drafter_dir), *extra)
    assert needle in msg


def test_empty_prompt_is_refused(capsys, qwen35_dir, drafter_dir, tmp_path):
    base = ["-m", str(qwen35_dir), "-d", str(drafter_dir)]
    assert "the prompt is empty" in _one_line_error(capsys, "  ", *base)
    (tmp_path / "p.txt").write_text("\n")
    assert "the prompt is empty" in _one_line_error(
        capsys, "--prompt-file", str(tmp_path / "p.txt"), *base
    )
    assert "not both" in _one_line_error(
        capsys, "x", "--prompt-file", str(tmp_path / "p.txt"), *base
    )


def test_mismatched_drafter_is_refused_naming_the_fix(
    capsys, qwen35_dir, qwen35_causal_dir, tmp_path
):
    wrong_hidden = ck.build_drafter(tmp_path / "h32", hidden_size=32)
    msg = _one_line_error(capsys, PROMPT, "-m", str(qwen35_dir), "-d", str(wrong_hidden))
    assert "hidden size 32 but the target has 64" in msg and "pass the drafter trained" in msg
    four_layer = ck.build_drafter(tmp_path / "l4")  # for 4-layer targets
    msg = _one_line_error(capsys, PROMPT, "-m", str(qwen35_causal_dir), "-d", str(four_layer))
    assert "target of 4 layers but the target has 8" in msg
    bad_mask = ck.build_drafter(tmp_path / "mask", mask_token_id=4096, vocab_size=512)
    msg = _one_line_error(capsys, PROMPT, "-m", str(qwen35_dir), "-d", str(bad_mask))
    assert "mask_token_id 4096 is outside" in msg


@pytest.mark.parametrize(
    ("patch", "needle"),
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2 drafter"),
        ({"speculators_config": {"aux_hidden_state_layer_ids": [1]}}, "speculators"),
        ({"architectures": ["LlamaForCausalLM"], "dflash_config": None}, "not a DFlash drafter"),
    ],
)
def test_unknown_drafter_formats_are_refused(capsys, qwen35_dir, tmp_path, patch, needle):
    d = ck.build_drafter(tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    for k, v in patch.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    assert needle in _one_line_error(capsys, PROMPT, "-m", str(qwen35_dir), "-d", str(d))


def test_model_and_draft_swapped_are_refused(capsys, qwen35_dir, drafter_dir):
    msg = _one_line_error(capsys, PROMPT, "-m", str(drafter_dir), "-d", str(qwen35_dir))
    assert "is a DFlash drafter, not a target model: pass it with --draft" in msg
    msg = _one_line_error(capsys, PROMPT, "-m", str(qwen35_dir), "-d", str(qwen35_dir))
    assert "not a DFlash drafter" in msg


def test_target_without_registry_entry_needs_draft(capsys, qwen35_dir):
    msg = _one_line_error(capsys, PROMPT, "-m", str(qwen35_dir))
    assert "no drafter is registered" in msg and "--draft" in msg


def test_no_model_without_demo_pair_is_one_clear_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("hf2q.runtime.pair._package_dir", lambda: tmp_path)
    msg = _one_line_error(capsys, PROMPT)
    assert "no embedded demo pair" in msg and "--model" in msg


def test_demo_pair_runs_once_its_folders_exist(
    capsys, monkeypatch, tmp_path, qwen35_dir, drafter_dir
):
    pkg = tmp_path / "hf2q"
    shutil.copytree(qwen35_dir, pkg / "demo" / "target")
    shutil.copytree(drafter_dir, pkg / "demo" / "draft")
    (pkg / "configs").mkdir()
    shutil.copy(Path(__file__).parents[1] / "configs" / "registry.toml", pkg / "configs")
    monkeypatch.setattr("hf2q.runtime.pair._package_dir", lambda: pkg)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # nothing piped in: the demo's own prompt
    rec = generate_json(capsys, "-n", "4")
    assert rec["mode"] == "dflash" and len(rec["tokens"]) == 4
    assert rec["model"].endswith("demo/target") and rec["draft"].endswith("demo/draft")
    # The registry marks the demo as raw text: no chat template turns around the prompt.
    from transformers import AutoTokenizer

    from hf2q.runtime.pair import demo_pair, encode_prompt

    entry = demo_pair()[2]
    raw = encode_prompt(AutoTokenizer.from_pretrained(qwen35_dir), entry["prompt"], chat=False)
    assert entry["chat"] is False and rec["prompt_tokens"] == len(raw)


# ---- BLAS decision (a pure function: no OpenBLAS needed) ----------------------------------------
LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


@pytest.mark.parametrize(
    ("kw", "action"),
    [
        ({}, "reexec"),
        ({"installed": None}, "hint"),
        ({"loaded_kind": "optimized"}, "keep"),
        ({"backend": "cuda"}, "keep"),
        ({"system": "darwin", "backend": "metal"}, "keep"),
        ({"env": {"HF2Q_BLAS": "bundled"}}, "keep"),
        ({"env": {"HF2Q_BLAS_REEXEC": "1"}}, "hint"),
        ({"env": {"LD_PRELOAD": LIB}}, "hint"),
    ],
)
def test_blas_plan(kw, action):
    args = dict(
        system="linux", backend="cpu", loaded_kind="reference (slow)", installed=LIB, env={}
    )
    args.update(kw)
    plan = plan_blas(**args)
    assert isinstance(plan, BlasPlan) and plan.action == action, plan
    if action == "reexec":
        assert plan.library == LIB


def test_blas_plan_honours_an_explicit_library(tmp_path):
    lib = tmp_path / "libmkl_rt.so"
    lib.write_bytes(b"")
    plan = plan_blas(
        system="linux",
        backend="cpu",
        loaded_kind="reference (slow)",
        installed=None,
        env={"HF2Q_BLAS": str(lib)},
    )
    assert plan.action == "reexec" and plan.library == str(lib)


def test_pip_installed_mkl_is_found_under_the_prefix_newest_version_first(tmp_path):
    from hf2q.platform import find_pip_mkl

    empty, venv = tmp_path / "empty", tmp_path / "venv"
    (empty / "lib").mkdir(parents=True)
    (venv / "lib").mkdir(parents=True)
    for name in ("libmkl_rt.so.2", "libmkl_rt.so.3", "libmkl_core.so.3"):
        (venv / "lib" / name).write_bytes(b"")
    assert find_pip_mkl((str(empty),)) is None
    assert find_pip_mkl((str(empty), str(venv))) == str(venv / "lib" / "libmkl_rt.so.3")


def test_preloading_mkl_picks_a_threading_layer_that_runs_without_intel_openmp():
    from hf2q.platform import REEXEC_GUARD, preload_env

    mkl = "/venv/lib/libmkl_rt.so.3"
    env = preload_env(mkl, {"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{mkl}:/other.so" and env[REEXEC_GUARD] == "1"
    assert env["MKL_THREADING_LAYER"] == "SEQUENTIAL" and env["PATH"] == "/bin"
    # The user's choice stands; OpenBLAS gets no MKL setting.
    assert preload_env(mkl, {"MKL_THREADING_LAYER": "INTEL"})["MKL_THREADING_LAYER"] == "INTEL"
    assert "MKL_THREADING_LAYER" not in preload_env(LIB, {})


def test_the_hint_to_preload_mkl_by_hand_names_its_threading_layer():
    from hf2q.platform import BlasPlan, blas_hint

    mkl = "/venv/lib/libmkl_rt.so.3"
    hint = blas_hint(BlasPlan("hint", mkl, "not re-executing a process hf2q does not own"))
    assert f"MKL_THREADING_LAYER=SEQUENTIAL LD_PRELOAD={mkl}" in hint
    assert f"run with LD_PRELOAD={LIB} to use it" in blas_hint(BlasPlan("hint", LIB, ""))


def test_the_blas_hint_names_both_ways_to_a_fast_blas():
    from hf2q.platform import BlasPlan, blas_hint

    hint = blas_hint(BlasPlan("hint", None, "no optimized BLAS is installed"))
    assert "apt-get install libopenblas0-pthread" in hint and "pip install mkl" in hint
    assert "HF2Q_BLAS=bundled" in hint


def test_blas_kind_says_when_the_gpu_makes_it_irrelevant():
    from hf2q.platform import blas_role

    # The H200 stats used to read "reference (slow)" although MLX computed on the GPU.
    assert blas_role("reference (slow)", "cpu") == "reference (slow)"
    role = blas_role("reference (slow)", "cuda")
    assert role.startswith("reference (slow)") and "not used: MLX computes on cuda" in role


def test_in_process_calls_never_reexec(capsys, qwen35_dir):
    # Called from Python (argv given), hf2q must not replace the caller's process.
    rec = generate_json(capsys, PROMPT, "-m", str(qwen35_dir), "--no-dflash", "-n", "2")
    assert rec["generation_tokens"] == 2


def _subprocess_json(args: list[str], env_extra: dict[str, str]) -> dict:
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "HF2Q_BLAS", "HF2Q_BLAS_REEXEC")
    }
    env.update(env_extra)
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    proc = subprocess.run(
        [sys.executable, "-m", "hf2q", "generate", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_process_preloads_openblas_when_installed(qwen35_dir):
    from hf2q.platform import find_openblas

    if find_openblas() is None:
        pytest.skip("OpenBLAS is not installed here (apt-get install libopenblas0-pthread)")
    args = [PROMPT, "-m", str(qwen35_dir), "--no-dflash", "-n", "3"]
    fast = _subprocess_json(args, {})
    assert fast["blas_kind"] == "optimized" and "openblas" in fast["blas"]


def test_cli_process_preloads_a_pip_installed_mkl(qwen35_dir):
    from hf2q.platform import find_openblas, find_pip_mkl

    if find_openblas() is not None or find_pip_mkl() is None:
        pytest.skip("needs 'pip install mkl' and no system OpenBLAS (which hf2q prefers)")
    args = [PROMPT, "-m", str(qwen35_dir), "--no-dflash", "-n", "3"]
    fast = _subprocess_json(args, {})
    assert fast["blas_kind"] == "optimized" and "libmkl_rt" in fast["blas"]
