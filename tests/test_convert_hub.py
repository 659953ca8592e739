"""The Hub path of ``hf2q convert``, against huggingface_hub's own cache layout, offline.

A tiny checkpoint is placed in a Hugging Face cache (``models--owner--name/blobs``,
``snapshots/<commit>``, ``refs/main``) that ``huggingface_hub.scan_cache_dir`` recognises; then
``hf2q convert owner/name`` runs in a fresh process with ``HF_HUB_OFFLINE=1`` and ``HF_HOME`` or
``HF_HUB_CACHE`` pointing there, so hf2q's real resolution code (``snapshot_download``) runs.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import checkpoints as ck
import pytest

from hf2q.cli.app import main

ROOT = Path(__file__).parents[1]
REPO = "hf2q-test/tiny-qwen35"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("hub")
    src = ck.build_qwen35(root / "src", seed=40)
    home = root / "home"
    commit = ck.add_to_hf_cache(home / "hub", REPO, src)
    return home, commit


def test_prepared_cache_is_what_huggingface_hub_sees(hf_home):
    from huggingface_hub import scan_cache_dir

    home, commit = hf_home
    info = scan_cache_dir(home / "hub")
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == commit and "main" in revision.refs
    assert {f.file_name for f in revision.files} >= {"config.json", "model.safetensors"}


def test_convert_by_repo_id_from_the_cache_offline(hf_home, tmp_path):
    home, commit = hf_home
    # One fresh process (huggingface_hub reads HF_HOME / HF_HUB_CACHE at import) runs several
    # conversions through hf2q's CLI entry point and reports each exit code and summary.
    runs = [
        [REPO, "-o", str(tmp_path / "a"), "--json", "--q-bits", "8"],
        [REPO, "-o", str(tmp_path / "b"), "--json", "--no-eval", "--revision", commit],
        [REPO, "-o", str(tmp_path / "c"), "--revision", "v9.9"],
    ]
    script = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from hf2q.cli.app import main
        results = []
        for args in json.loads(sys.argv[1]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(["convert", *args])
            results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
        print(json.dumps(results))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    a, b, c = json.loads(run.stdout.strip().splitlines()[-1])
    snapshot = str(home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit)

    assert a["code"] == 0, a["err"]
    summary = json.loads(a["out"].strip().splitlines()[-1])
    assert summary["source"] == REPO and summary["source_path"] == snapshot
    assert summary["quantization"]["bits"] == 8

    from mlx_lm import load

    load(str(tmp_path / "a"))  # stock mlx-lm opens what came from the cache

    assert b["code"] == 0, b["err"]
    assert json.loads(b["out"].strip().splitlines()[-1])["source_path"] == snapshot

    assert c["code"] == 2
    (line,) = c["err"].strip().splitlines()
    assert "hf2q-test/tiny-qwen35 at revision v9.9" in line and "hf download" in line
    assert not (tmp_path / "c").exists()


def test_offline_with_nothing_cached_is_one_line_naming_the_fix(tmp_path, capsys):
    # conftest sets HF_HUB_OFFLINE=1; this repo is in no cache.
    assert main(["convert", "nobody-here/no-such-model", "-o", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "hf2q: error: nobody-here/no-such-model is not in the Hugging Face cache and "
        "HF_HUB_OFFLINE is set: download it once with network access ('hf download "
        "nobody-here/no-such-model'), or pass a local folder"
    )
    assert not (tmp_path / "out").exists()


def test_download_progress_draws_with_rich(monkeypatch):
    from rich.console import Console

    from hf2q.cli import console

    buffer = io.StringIO()
    monkeypatch.setattr(console, "err", Console(file=buffer, force_terminal=True, width=100))
    with console.hub_download_progress() as tqdm_class:
        bar = tqdm_class(total=4 << 20, desc="Downloading", unit="B")
        bar.update(2 << 20)
        bar.close()
        files = tqdm_class(total=3, desc="Fetching 3 files")
        files.update(3)
        files.close()
    text = buffer.getvalue()
    assert "Downloading" in text and "MB" in text and "3/3 files" in text
