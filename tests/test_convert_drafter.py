"""``hf2q convert`` on DFlash drafters in z-lab's format: the output stays in that format.

Unquantized: hf2q's ``load_drafter`` reads weights identical to the source's, and z-lab's own
``dflash.model_mlx.load_draft`` (which only takes Hub repo ids) loads it from a Hugging Face
cache. Quantized: the weights reload with a bounded relative error (8-bit <= 1%, 4-bit <= 12%).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import checkpoints as ck
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from hf2q.cli.app import main


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer drafter with a sliding-window layer, bf16 like z-lab's releases."""
    return ck.build_drafter(
        tmp_path_factory.mktemp("drafter") / "src",
        layers=2,
        seed=5,
        dtype="bfloat16",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )


def _weights(folder: Path) -> dict[str, mx.array]:
    from hf2q.runtime.drafter import load_drafter

    return dict(tree_flatten(load_drafter(folder).parameters()))


def _dequantized(folder: Path) -> dict[str, mx.array]:
    """Drafter weights as float, dequantizing quantized layers (keys as in the float model)."""
    from hf2q.runtime.drafter import load_drafter

    model = load_drafter(folder)
    out = {}
    for path, module in model.named_modules():
        if hasattr(module, "scales"):
            out[f"{path}.weight"] = mx.dequantize(
                module.weight,
                module.scales,
                module.get("biases"),
                group_size=module.group_size,
                bits=module.bits,
                mode=module.mode,
            )
    for name, value in tree_flatten(model.parameters()):
        stem = name.rsplit(".", 1)[0]
        if f"{stem}.weight" not in out and not name.endswith((".scales", ".biases")):
            out[name] = value
    return out


def test_unquantized_drafter_reloads_with_identical_weights(drafter, tmp_path):
    out = tmp_path / "out"
    assert main(["convert", str(drafter), "-o", str(out), "--no-quantize", "--json"]) == 0
    want, got = _weights(drafter), _weights(out)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == mx.bfloat16
        assert mx.array_equal(got[name], want[name]).item(), name
    config = json.loads((out / "config.json").read_text())
    source = json.loads((drafter / "config.json").read_text())
    assert config["dflash_config"] == source["dflash_config"]
    assert config["layer_types"] == source["layer_types"]
    assert "quantization" not in config
    # z-lab's names, no prefix: what their loader and ours read.
    stored = mx.load(str(out / "model.safetensors"))
    assert "fc.weight" in stored and "layers.0.self_attn.q_proj.weight" in stored


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.01), (4, 0.12)])
def test_quantized_drafter_reloads_with_bounded_error(drafter, tmp_path, bits, bound, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(drafter), "-o", str(out), "--q-bits", str(bits), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["kind"] == "drafter"
    assert summary["eval"]["weight_rel_error_max"] <= bound
    want, got = _weights(drafter), _dequantized(out)
    assert set(got) == set(want)
    worst = 0.0
    for name, w in want.items():
        w32, g32 = w.astype(mx.float32), got[name].astype(mx.float32)
        rel = (mx.sqrt(mx.sum((g32 - w32) ** 2) / mx.sum(w32**2))).item()
        worst = max(worst, rel)
    assert 0 < worst <= bound
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits


def test_drafter_recipe_with_per_layer_bits_reloads(drafter, tmp_path):
    recipe = tmp_path / "edges.toml"
    recipe.write_text(
        textwrap.dedent(
            """
            description = "drafter: 4-bit, first layer's projections at 8 bits, fc in float"
            [default]
            bits = 4
            [[rule]]
            match = '^fc$'
            quantize = false
            [[rule]]
            match = 'proj$'
            first_layers = 1
            bits = 8
            """
        )
    )
    out = tmp_path / "out"
    assert main(["convert", str(drafter), "-o", str(out), "--recipe", str(recipe)]) == 0
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["layers.0.self_attn.q_proj"]["bits"] == 8
    assert "layers.1.self_attn.q_proj" not in quant  # the default: 4 bits
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["fc.weight"].dtype == mx.bfloat16
    model_weights = _dequantized(out)
    want = _weights(drafter)
    assert mx.array_equal(model_weights["fc.weight"], want["fc.weight"]).item()


def test_zlab_loader_reads_the_unquantized_output_from_a_hub_cache(drafter, tmp_path):
    try:
        import dflash.model_mlx  # noqa: F401

        extra_path = ""
    except ImportError:
        if not Path("/tmp/dfl/x/dflash/model_mlx.py").exists():
            pytest.skip(
                "z-lab's dflash package is not installed (pip install --no-deps dflash==0.1.0)"
            )
        extra_path = "/tmp/dfl/x"
    out = tmp_path / "out"
    assert main(["convert", str(drafter), "-o", str(out), "--no-quantize"]) == 0
    cache = tmp_path / "hub"
    ck.add_to_hf_cache(cache, "local/drafter-hf2q", out)
    # z-lab's load_draft only takes repo ids: it resolves them with snapshot_download, offline here.
    script = textwrap.dedent(
        f"""
        import sys
        if {extra_path!r}:
            sys.path.insert(0, {extra_path!r})
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from dflash.model_mlx import load_draft
        from hf2q.runtime.drafter import load_drafter
        theirs = dict(tree_flatten(load_draft("local/drafter-hf2q").parameters()))
        ours = dict(tree_flatten(load_drafter({str(drafter)!r}).parameters()))
        assert set(theirs) == set(ours), sorted(set(theirs) ^ set(ours))
        assert all(mx.array_equal(theirs[k], ours[k]).item() for k in ours)
        print("ZLAB-OK", len(ours))
        """
    )
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ZLAB-OK" in run.stdout


def test_dflash2_drafter_is_refused_with_a_clear_message(tmp_path, capsys):
    src = ck.build_drafter(tmp_path / "d2", architectures=["DFlash2DraftModel"])
    out = tmp_path / "out"
    assert main(["convert", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DFlash2" in err[0] and "not support" in err[0]
    assert not out.exists()
