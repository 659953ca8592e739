"""``hf2q convert`` on checkpoints written by transformers itself: every layout loads with stock
``mlx_lm.load`` and computes what transformers computes.

Fixtures are tiny models fitted for a few dozen steps to a fixed text (see
``checkpoints._train``), so their next-token choices on that text are confident and every layer
matters: "top-1 agreement" then measures the conversion, not noise. Tolerances (stated here and in
the README):

* float32 output vs transformers' float32 forward: max |logit difference| <= 1e-4.
* bfloat16 source and output: every parameter bit-identical to what stock ``mlx_lm.load`` makes of
  the source (an exact oracle), and vs transformers' bfloat16 forward top-1 agreement >= 0.95 and
  max |logit difference| <= 8 bf16 ulps of the largest logit (two bf16 forwards with different
  accumulation orders drift by a few ulps over the layers: 0.36 measured with transformers 5.25 on
  logits of magnitude ~14, where 8 ulps is 0.5).
* 8-bit affine vs transformers' float32 forward: top-1 agreement >= 0.95.
* 4-bit affine vs transformers' float32 forward: top-1 agreement >= 0.85.
* Every quantized output equals, to 1e-5, what mlx-lm computes after quantizing the float output in
  memory with its own ``quantize_model`` (an exact oracle for each mode and layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import checkpoints as ck
import mlx.core as mx
import numpy as np
import pytest

from hf2q.cli.app import main

TRAIN_STEPS = 30
AGREE_8BIT = 0.95
AGREE_4BIT = 0.85


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Trained tiny checkpoints in the four layouts, MTP tensors added to the released layouts."""
    root = tmp_path_factory.mktemp("trained")
    return {
        "conditional": ck.build_qwen35(
            root / "conditional", mtp=True, train_steps=TRAIN_STEPS, seed=10
        ),
        "causal": ck.build_qwen35(
            root / "causal", layout="causal", num_hidden_layers=8, train_steps=TRAIN_STEPS, seed=11
        ),
        "moe": ck.build_qwen35(root / "moe", moe=True, mtp=True, train_steps=TRAIN_STEPS, seed=12),
        "qwen3": ck.build_qwen3(root / "qwen3", train_steps=2 * TRAIN_STEPS, seed=13),
    }


def _convert(src: Path, out: Path, *flags: str) -> dict:
    code = main(["convert", str(src), "-o", str(out), "--json", *flags])
    assert code == 0
    return json.loads((out / "hf2q.json").read_text())


def _text_ids(folder: Path) -> list[int]:
    return ck.training_ids(folder)[:64]


def _hf_logits(folder: Path, ids: list[int], dtype: str = "float32") -> np.ndarray:
    import torch
    import transformers as tf

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = getattr(tf, arch).from_pretrained(folder, dtype=torch_dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _mlx_logits(out: Path, ids: list[int]) -> np.ndarray:
    from mlx_lm import load

    model, _ = load(str(out))
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


LAYOUTS = ["conditional", "causal", "moe", "qwen3"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float_output_loads_with_stock_mlx_lm_and_matches_transformers(layout, trained, tmp_path):
    src = trained[layout]
    out = tmp_path / "out"
    summary = _convert(src, out, "--no-quantize")
    ids = _text_ids(src)
    got = _mlx_logits(out, ids)
    want = _hf_logits(src, ids)
    np.testing.assert_allclose(got, want, atol=1e-4)
    # The fixture really is confident, so the agreement thresholds below mean something.
    probs = np.exp(want - want.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert probs.max(-1).mean() > 0.8
    assert summary["quantization"] is None
    assert summary["bits_per_weight"] == pytest.approx(32.0, rel=1e-3)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("bits", "threshold"), [(8, AGREE_8BIT), (4, AGREE_4BIT)])
def test_quantized_output_agrees_with_transformers_top1(layout, bits, threshold, trained, tmp_path):
    src = trained[layout]
    out = tmp_path / "out"
    summary = _convert(src, out, "--q-bits", str(bits))
    ids = _text_ids(src)
    got = _mlx_logits(out, ids)
    want = _hf_logits(src, ids)
    agreement = float((got.argmax(-1) == want.argmax(-1)).mean())
    assert agreement >= threshold, f"{layout} {bits}-bit top-1 agreement {agreement:.3f}"
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    assert config["quantization_config"] == config["quantization"]
    assert summary["eval"]["top1_agreement"] > 0
    assert bits < summary["bits_per_weight"] < bits + 2


def _bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) at magnitude ``x``."""
    return 2.0 ** (np.floor(np.log2(x)) - 7)


def test_bfloat16_checkpoint_stays_bfloat16_and_matches_transformers(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm import load

    src = ck.build_qwen35(tmp_path / "bf16", dtype="bfloat16", train_steps=TRAIN_STEPS, seed=14)
    out = tmp_path / "out"
    summary = _convert(src, out, "--no-quantize")
    assert summary["dtype"] == "bfloat16"
    weights = mx.load(str(out / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.bfloat16}
    # Exact: the converted model's parameters are what stock mlx-lm makes of the source itself.
    ours = dict(tree_flatten(load(str(out))[0].parameters()))
    stock = dict(tree_flatten(load(str(src))[0].parameters()))
    assert sorted(ours) == sorted(stock)
    for name, value in stock.items():
        assert ours[name].dtype == value.dtype and mx.array_equal(ours[name], value).item(), name
    # Against transformers' own bfloat16 forward: same predictions, logits a few ulps apart.
    ids = _text_ids(src)
    got = _mlx_logits(out, ids)
    want = _hf_logits(src, ids, dtype="bfloat16")
    assert float((got.argmax(-1) == want.argmax(-1)).mean()) >= 0.95
    assert np.abs(got - want).max() <= 8 * _bf16_ulp(float(np.abs(want).max()))


def test_dtype_casts_everything_but_a_log(trained, tmp_path):
    out = tmp_path / "out"
    summary = _convert(
        trained["conditional"], out, "--dtype", "bfloat16", "--q-bits", "4", "--no-eval"
    )
    weights = mx.load(str(out / "model.safetensors"))
    a_log = [k for k in weights if k.endswith("A_log")]
    assert a_log and all(weights[k].dtype == mx.float32 for k in a_log)  # mlx-lm's cast rule
    others = {v.dtype for k, v in weights.items() if not k.endswith("A_log")}
    assert others == {mx.bfloat16, mx.uint32}  # scales and biases follow --dtype too
    assert summary["dtype"] == "bfloat16"
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) in (None, "bfloat16")


def _mlx_lm_quantized_oracle(float_out: Path, ids: list[int], **qargs) -> np.ndarray:
    """mlx-lm's own path: load the float output, quantize in memory with quantize_model."""
    from mlx_lm import load
    from mlx_lm.utils import quantize_model

    model, _, config = load(str(float_out), return_config=True)
    model, _ = quantize_model(model, config, **qargs)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_4bit_output_equals_mlx_lm_quantizing_in_memory(layout, trained, tmp_path):
    src = trained[layout]
    _convert(src, tmp_path / "float", "--no-quantize")
    _convert(src, tmp_path / "q4", "--q-bits", "4", "--no-eval")
    ids = _text_ids(src)
    want = _mlx_lm_quantized_oracle(tmp_path / "float", ids, group_size=64, bits=4)
    np.testing.assert_allclose(_mlx_logits(tmp_path / "q4", ids), want, atol=1e-5)


@pytest.mark.parametrize(
    ("flags", "qargs"),
    [
        (["--q-mode", "mxfp4"], dict(group_size=32, bits=4, mode="mxfp4")),
        (["--q-mode", "nvfp4"], dict(group_size=16, bits=4, mode="nvfp4")),
        (["--q-mode", "mxfp8"], dict(group_size=32, bits=8, mode="mxfp8")),
        (["--q-bits", "3", "--q-group-size", "32"], dict(group_size=32, bits=3)),
        (["--q-bits", "6"], dict(group_size=64, bits=6)),
    ],
    ids=["mxfp4", "nvfp4", "mxfp8", "affine3-g32", "affine6"],
)
def test_every_mode_equals_mlx_lm_quantizing_in_memory(flags, qargs, trained, tmp_path):
    src = trained["moe"]  # MoE: quantized switch layers, 8-bit router gates, experts fused by hf2q
    _convert(src, tmp_path / "float", "--no-quantize")
    summary = _convert(src, tmp_path / "q", *flags, "--no-eval")
    ids = _text_ids(src)
    want = _mlx_lm_quantized_oracle(tmp_path / "float", ids, **qargs)
    np.testing.assert_allclose(_mlx_logits(tmp_path / "q", ids), want, atol=1e-5)
    assert summary["quantization"]["mode"] == qargs.get("mode", "affine")


def test_rows_that_do_not_split_into_groups_stay_float(trained, tmp_path):
    # hidden 64, intermediate 128: with groups of 128 only down_proj (128 inputs) quantizes.
    out = tmp_path / "out"
    summary = _convert(trained["causal"], out, "--q-group-size", "128", "--no-eval")
    weights = mx.load(str(out / "model.safetensors"))
    layer = "language_model.model.layers.0."
    assert weights[layer + "mlp.down_proj.weight"].dtype == mx.uint32
    assert layer + "mlp.down_proj.scales" in weights
    assert weights[layer + "mlp.up_proj.weight"].dtype == mx.float32
    assert layer + "mlp.up_proj.scales" not in weights
    assert summary["precisions"]["affine 4-bit g128"] == 8  # one down_proj per layer
    ids = _text_ids(trained["causal"])
    assert _mlx_logits(out, ids).shape == (len(ids), ck.VOCAB_SIZE)


def test_output_is_byte_identical_to_mlx_lm_convert_on_the_released_layout(trained, tmp_path):
    from mlx_lm import convert as mlx_convert

    src = trained["conditional"]
    mlx_convert(str(src), str(tmp_path / "mlx"), quantize=True, q_bits=4, q_group_size=64)
    _convert(src, tmp_path / "hf2q", "--q-bits", "4", "--no-eval")
    theirs = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    ours = mx.load(str(tmp_path / "hf2q" / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert mx.array_equal(ours[name], value).item(), name
    a = json.loads((tmp_path / "mlx" / "config.json").read_text())["quantization"]
    b = json.loads((tmp_path / "hf2q" / "config.json").read_text())["quantization"]
    assert {k: v for k, v in a.items() if not isinstance(v, dict)} == {
        k: v for k, v in b.items() if not isinstance(v, dict)
    }


def test_chunks_and_worker_processes_write_the_same_bytes_as_whole_tensors(trained, tmp_path):
    from hf2q.convert import ConvertOptions, convert

    src = trained["moe"]  # pass-through tensors (streamed) and transformed ones (fused experts)
    runs = {
        "whole": ConvertOptions(chunk_bytes=1 << 30, workers=0),
        "chunks": ConvertOptions(chunk_bytes=1024, workers=0),
        "workers": ConvertOptions(chunk_bytes=1024, workers=2),
    }
    results = {name: convert(src, tmp_path / name, opts) for name, opts in runs.items()}
    assert results["workers"].workers == 2 and results["whole"].workers == 0
    files = results["whole"].files
    assert all(r.files == files for r in results.values())
    for name in files:
        if name.endswith(".safetensors"):
            whole = (tmp_path / "whole" / name).read_bytes()
            assert (tmp_path / "chunks" / name).read_bytes() == whole, name
            assert (tmp_path / "workers" / name).read_bytes() == whole, name
    # The quality check measures the same model whichever way it was written; the weight error
    # is an estimate on sampled rows, which depend on the chunking.
    a, b = results["workers"].eval, results["whole"].eval
    assert a.keys() == b.keys()
    for key in ("kl_mean", "kl_max", "top1_agreement", "tokens"):
        assert a[key] == pytest.approx(b[key], rel=1e-6)
    assert a["weight_rel_error_mean"] == pytest.approx(b["weight_rel_error_mean"], rel=0.1)


def test_sharded_output_has_an_index_that_names_every_tensor(trained, tmp_path):
    src = trained["causal"]
    out = tmp_path / "out"
    summary = _convert(src, out, "--q-bits", "8", "--shard-size", "0.0001", "--no-eval")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = {name: shard.name for shard in shards for name in mx.load(str(shard))}
    assert index["weight_map"] == dict(sorted(stored.items()))
    assert index["metadata"]["total_parameters"] == summary["parameters"]
    ids = _text_ids(src)
    assert (_mlx_logits(out, ids).argmax(-1) == _hf_logits(src, ids).argmax(-1)).mean() >= 0.95


def test_mtp_head_is_kept_aside_unquantized_and_vision_tower_dropped(trained, tmp_path):
    from safetensors.numpy import load_file

    src = trained["moe"]
    out = tmp_path / "out"
    summary = _convert(src, out, "--q-bits", "4", "--no-eval")
    source = {}
    for f in src.glob("*.safetensors"):
        source.update(load_file(str(f)))
    mtp_names = sorted(k for k in source if k.startswith("mtp."))
    assert mtp_names and summary["mtp"].startswith(f"kept aside: {len(mtp_names)} tensors")
    kept = load_file(str(out / "mtp.safetensors"))
    assert sorted(kept) == mtp_names
    for name in mtp_names:
        np.testing.assert_array_equal(kept[name], source[name])
    written = mx.load(str(out / "model.safetensors"))
    assert not [k for k in written if "mtp" in k or "visual" in k]
    assert summary["vision_tensors_dropped"] == len([k for k in source if "visual" in k]) > 0
    assert "vision_config" not in json.loads((out / "config.json").read_text())

    dropped = tmp_path / "dropped"
    summary = _convert(src, dropped, "--q-bits", "4", "--no-eval", "--drop-mtp")
    assert not (dropped / "mtp.safetensors").exists()
    assert summary["mtp"].startswith("dropped")


def test_output_carries_tokenizer_chat_template_and_both_eos_ids(trained, tmp_path):
    from mlx_lm import load

    src = trained["conditional"]
    out = tmp_path / "out"
    _convert(src, out, "--q-bits", "4", "--no-eval")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    _, tokenizer = load(str(out))
    assert tokenizer.chat_template == ck.CHAT_TEMPLATE
    assert set(tokenizer.eos_token_ids) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_hf2q_loader_and_target_adapter_open_the_output(trained, tmp_path):
    from hf2q.loading import load_model
    from hf2q.runtime.target import TargetModel

    src = trained["causal"]
    out = tmp_path / "out"
    _convert(src, out, "--recipe", "mixed-4-6", "--no-eval")
    loaded = load_model(out)
    ids = _text_ids(src)
    logits, _ = TargetModel(loaded.model, loaded.tokenizer).forward(mx.array([ids]))
    np.testing.assert_allclose(np.array(logits[0]), _mlx_logits(out, ids), atol=1e-5)


@pytest.mark.parametrize("layout", ["conditional", "moe"])
def test_quality_check_equals_kl_between_stock_mlx_lm_models(layout, trained, tmp_path):
    import mlx.nn as nn
    from mlx_lm import load

    from hf2q.convert.evaluate import EVAL_TEXT

    src = trained[layout]
    summary = _convert(src, tmp_path / "q", "--q-bits", "3")
    _convert(src, tmp_path / "float", "--no-quantize")
    qmodel, tokenizer = load(str(tmp_path / "q"))
    fmodel, _ = load(str(tmp_path / "float"))
    ids = mx.array([tokenizer.encode(EVAL_TEXT)[:64]])
    lf = nn.log_softmax(fmodel(ids)[0].astype(mx.float32), axis=-1)
    lq = nn.log_softmax(qmodel(ids)[0].astype(mx.float32), axis=-1)
    kl = mx.sum(mx.exp(lf) * (lf - lq), axis=-1)
    agree = mx.mean((mx.argmax(lf, -1) == mx.argmax(lq, -1)).astype(mx.float32))
    ev = summary["eval"]
    assert ev["tokens"] == ids.shape[1]
    assert ev["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-3, abs=1e-6)
    assert ev["kl_max"] == pytest.approx(kl.max().item(), rel=1e-3, abs=1e-6)
    assert ev["top1_agreement"] == pytest.approx(agree.item())
    assert 0 < ev["weight_rel_error_mean"] <= ev["weight_rel_error_max"] < 0.5
