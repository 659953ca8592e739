"""The package's ground rules: cheap CLI start-up, one-line errors, loading genuine checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hf2q.cli.app import main
from hf2q.errors import ModelError


def test_help_does_not_import_mlx_or_transformers():
    code = (
        "import sys; from hf2q.cli.app import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('mlx', 'mlx_lm', 'transformers', 'torch') if m in sys.modules]\n"
        "print('LOADED', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout


def test_version_flag_prints_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("hf2q ")


def test_unknown_command_is_one_line_error(capsys):
    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf2q: error:")


@pytest.mark.parametrize("name", ["qwen35_dir", "qwen35_causal_dir", "qwen35_moe_dir", "qwen3_dir"])
def test_transformers_checkpoints_load_and_match_transformers_logits(name, request):
    import mlx.core as mx
    import torch
    import transformers as tf

    from hf2q.loading import load_model
    from hf2q.runtime.target import TargetModel

    folder = request.getfixturevalue(name)
    loaded = load_model(folder)
    target = TargetModel(loaded.model, loaded.tokenizer)
    ids = loaded.tokenizer.encode("def add(a, b):\n    return a + b")
    logits, feats = target.forward(mx.array([ids]), None, capture=[0, 2])
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    hf_cls = getattr(tf, arch)
    hf = hf_cls.from_pretrained(folder).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    np.testing.assert_allclose(np.array(logits), out.logits.numpy(), atol=1e-4)
    # Features are decoder-layer outputs: HF's hidden_states[lid + 1].
    hs = out.hidden_states
    want = np.concatenate([hs[1].numpy(), hs[3].numpy()], axis=-1)
    np.testing.assert_allclose(np.array(feats), want, atol=1e-4)
    assert set(loaded.tokenizer.eos_token_ids) == {
        loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_unknown_architecture_is_refused_with_supported_list(tmp_path):
    from hf2q.loading import load_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match=r"unsupported architecture llama \(supported: qwen3_5"):
        load_model(tmp_path)


def test_float32_stays_exact_on_cuda_unless_the_user_opts_into_tf32():
    from hf2q.platform import keep_float32_exact

    env: dict[str, str] = {}
    keep_float32_exact(env)
    assert env == {"MLX_ENABLE_TF32": "0"}
    env = {"MLX_ENABLE_TF32": "1"}
    keep_float32_exact(env)
    assert env == {"MLX_ENABLE_TF32": "1"}
