"""The embedded demo pair: shipped in the package, small, loads like ``hf2q generate`` loads it,
round-trips through z-lab's loader, and greedy DFlash on it equals plain greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from zlab_check import assert_zlab_loads_like_hf2q

import hf2q

DEMO = Path(hf2q.__file__).resolve().parent / "demo"

# Short Python snippets in the style of the stdlib (not taken from its held-out files).
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
    "    def test_empty(self):\n        self.assertEqual(",
]


def test_the_pair_ships_in_the_package_within_25_mb_in_the_genuine_layouts():
    target, draft = DEMO / "target", DEMO / "draft"
    size = sum(f.stat().st_size for d in (target, draft) for f in d.iterdir())
    assert size <= 25e6, size
    tcfg = json.loads((target / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3_5ForCausalLM"]
    types = tcfg["layer_types"]
    assert "linear_attention" in types and "full_attention" in types  # hybrid Gated DeltaNet
    assert (target / "tokenizer.json").is_file() and (target / "generation_config.json").is_file()
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["architectures"] == ["DFlashDraftModel"] and dcfg["block_size"] == 16
    assert dcfg["num_target_layers"] == len(types)


def test_hf2q_loads_the_pair_with_no_model_arguments_as_raw_text():
    from hf2q.runtime.pair import load_pair

    pair = load_pair(None)
    assert pair.drafter is not None and not pair.chat_default
    assert pair.default_prompt and pair.target.num_layers == len(pair.target.layers)


def test_z_labs_loader_reads_the_shipped_drafter(tmp_path):
    pytest.importorskip("dflash.model_mlx")
    assert_zlab_loads_like_hf2q(DEMO / "target", DEMO / "draft", tmp_path)


def test_greedy_dflash_on_the_pair_equals_plain_greedy_in_float32():
    import mlx.core as mx

    from hf2q.runtime.dflash import dflash_generate, plain_generate, run
    from hf2q.runtime.pair import encode_prompt, load_pair

    pair = load_pair(None)
    # Token-exact comparisons run in float32 (bfloat16 has exact ties that may round apart).
    pair.target.model.set_dtype(mx.float32)
    pair.drafter.set_dtype(mx.float32)
    accepted = 0
    for text in PROMPTS:
        ids = encode_prompt(pair.tokenizer, text, chat=False)
        plain = run(plain_generate(pair.target, ids, max_tokens=48))
        fast = run(dflash_generate(pair.target, pair.drafter, ids, max_tokens=48))
        assert fast.tokens == plain.tokens, text
        accepted += sum(a * n for a, n in enumerate(fast.accepted_histogram))
    assert accepted > 0  # the drafter's tokens were actually accepted, not just the bonus ones


def test_hf2q_generate_with_no_model_arguments_runs_the_pair_offline(tmp_path):
    """The out-of-the-box command: no model, no prompt, no network; DFlash drafts get accepted."""
    import os
    import subprocess
    import sys

    root = Path(hf2q.__file__).resolve().parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty-hub"))
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-m", "hf2q", "generate", "--dflash", "-n", "48", "--json"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(rec["model"]).resolve() == (DEMO / "target").resolve()
    assert Path(rec["draft"]).resolve() == (DEMO / "draft").resolve()
    from hf2q.runtime.pair import encode_prompt, load_pair, read_registry

    # The registry's demo prompt, as raw text (no chat template around it).
    tok = load_pair(None, dflash=False).tokenizer
    prompt = read_registry()["demo"]["prompt"]
    assert rec["prompt_tokens"] == len(encode_prompt(tok, prompt, chat=False))
    assert rec["mode"] == "dflash" and rec["generation_tokens"] == 48
    hist = rec["accepted_histogram"]
    assert sum(a * n for a, n in enumerate(hist)) > 0, rec  # drafted tokens were accepted
