"""``hf2q convert`` as a real process: exit codes, ``--json`` on the last line, and signals.

Killing the process at any point leaves no OUT: Ctrl-C (SIGINT) and SIGTERM remove the hidden
partial folder and exit 130; SIGKILL leaves only ``.OUT.hf2q-partial-<pid>``, which the next
conversion into the same place removes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import checkpoints as ck
import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Big enough that writing plus the quality check take a noticeable moment."""
    return ck.build_qwen35(
        tmp_path_factory.mktemp("proc") / "src",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        seed=30,
    )


def _start(*args: str) -> subprocess.Popen[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.Popen(
        [sys.executable, "-m", "hf2q", "convert", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell running us in the background may ignore SIGINT; the child must not inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.hf2q-partial-*"))


def _wait_for_partial(proc: subprocess.Popen[str], out: Path) -> Path:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = _partials(out)
        if found:
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    proc.kill()
    raise AssertionError("the conversion never started writing")


def test_json_is_the_last_line_and_exit_code_is_zero(medium, tmp_path):
    out = tmp_path / "out"
    proc = _start(str(medium), "-o", str(out), "--q-bits", "8", "--json")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["output"] == str(out) and summary["quantization"]["bits"] == 8
    assert summary["eval"]["top1_agreement"] > 0.5
    assert json.loads((out / "hf2q.json").read_text())["parameters"] == summary["parameters"]


def test_bad_input_exits_2_with_one_line(tmp_path):
    proc = _start(str(tmp_path), "-o", str(tmp_path / "out"))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert stderr.strip().splitlines() == [
        f"hf2q: error: {tmp_path} has no config.json: pass a Hugging Face checkpoint folder (or a Hub repo id)"
    ]
    assert stdout == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_mid_convert_removes_everything(medium, tmp_path, sig):
    out = tmp_path / "out"
    proc = _start(str(medium), "-o", str(out), "--workers", "2")
    _wait_for_partial(proc, out)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "hf2q: error: interrupted"
    assert not out.exists()
    assert _partials(out) == []


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigkill_mid_convert_leaves_no_out_no_workers_and_the_next_run_cleans_up(medium, tmp_path):
    out = tmp_path / "out"
    proc = _start(str(medium), "-o", str(out), "--workers", "2")
    partial = _wait_for_partial(proc, out)
    workers = _children(proc.pid)
    assert len(workers) >= 2  # the quantization processes
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert partial.name == f".out.hf2q-partial-{proc.pid}"
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers), "worker processes outlived a killed conversion"
    again = _start(str(medium), "-o", str(out), "--no-eval")
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert (out / "model.safetensors").exists()
    assert _partials(out) == [] and not partial.exists()
