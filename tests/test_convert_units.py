"""Pieces of ``hf2q convert`` on their own: quantization settings, recipes, safetensors I/O."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest

from hf2q.convert.recipes import Policy, available_recipes, load_recipe, make_spec
from hf2q.convert.safetensors_io import ShardWriter, as_bytes, read_header, read_rows
from hf2q.errors import ModelError, UsageError


@pytest.mark.parametrize(
    ("mode", "bits", "group"),
    [("affine", 4, 64), ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)],
)
def test_each_mode_gets_mlx_defaults(mode, bits, group):
    spec = make_spec(mode=mode)
    assert (spec.bits, spec.group_size, spec.mode) == (bits, group, mode)
    w = mx.random.normal((8, 64))
    mx.eval(mx.quantize(w, group_size=spec.group_size, bits=spec.bits, mode=spec.mode))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_affine_combination_is_accepted_and_runs(bits, group):
    spec = make_spec(bits, group)
    mx.eval(mx.quantize(mx.ones((2, 128)), group_size=spec.group_size, bits=spec.bits))


def test_impossible_combinations_name_the_fix():
    with pytest.raises(UsageError, match="takes 2, 3, 4, 5, 6, 8 bits, not 1"):
        make_spec(1)
    with pytest.raises(UsageError, match="nvfp4 quantization takes group size 16, not 64"):
        make_spec(None, 64, "nvfp4")


def _policy(name: str, layers: int = 16) -> Policy:
    recipe = load_recipe(name)
    return Policy(make_spec(**recipe.default), recipe=recipe, num_layers=layers)


def _bits(policy: Policy, path: str) -> int | None:
    spec = policy.decide(path, None)
    return None if spec is None else spec.bits


def test_shipped_recipes_parse_and_protect_what_they_say():
    assert set(available_recipes()) >= {"mixed-4-6", "mixed-3-6", "mixed-6-8", "mxfp4-mixed"}
    lm = "language_model.model."
    p = _policy("mixed-4-6")
    assert _bits(p, lm + "embed_tokens") == 6
    assert _bits(p, "language_model.lm_head") == 6
    assert _bits(p, lm + "layers.3.linear_attn.in_proj_a") is None
    assert _bits(p, lm + "layers.3.linear_attn.in_proj_b") is None
    assert _bits(p, lm + "layers.3.mlp.gate") == 8
    assert _bits(p, lm + "layers.3.mlp.shared_expert_gate") == 8
    # first and last eighth of 16 layers: 0, 1 and 14, 15
    for layer, want in [(0, 6), (1, 6), (2, 4), (13, 4), (14, 6), (15, 6)]:
        assert _bits(p, f"{lm}layers.{layer}.self_attn.v_proj") == want
        assert _bits(p, f"{lm}layers.{layer}.mlp.down_proj") == want
    assert _bits(p, lm + "layers.0.mlp.switch_mlp.down_proj") == 6
    assert _bits(p, lm + "layers.5.mlp.up_proj") == 4
    assert _bits(_policy("mixed-3-6"), lm + "layers.5.mlp.up_proj") == 3
    assert _bits(_policy("mixed-6-8"), lm + "embed_tokens") == 8
    mxfp4 = _policy("mxfp4-mixed")
    assert mxfp4.decide(lm + "layers.5.mlp.up_proj", None).mode == "mxfp4"
    head = mxfp4.decide("lm_head", None)
    assert (head.mode, head.bits, head.group_size) == ("affine", 8, 64)


def test_layer_counts_and_fractions_in_rules(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        "[[rule]]\nmatch = 'q_proj$'\nfirst_layers = 2\nlast_layers = 0.25\nbits = 8\n"
    )
    p = Policy(make_spec(4), recipe=load_recipe(str(recipe)), num_layers=8)
    got = [_bits(p, f"model.layers.{i}.self_attn.q_proj") for i in range(8)]
    assert got == [8, 8, 4, 4, 4, 4, 8, 8]
    assert _bits(p, "model.embed_tokens") == 4


def test_mlx_lm_model_predicate_applies_when_no_rule_matches():
    p = Policy(
        make_spec(4),
        model_predicate=lambda path, m: (
            {"group_size": 64, "bits": 8} if path.endswith("gate") else True
        ),
    )
    assert _bits(p, "x.mlp.gate") == 8 and _bits(p, "x.mlp.up_proj") == 4


def test_shard_writer_round_trips_through_safetensors_readers(tmp_path):
    import torch
    from safetensors.torch import load_file

    rng = np.random.default_rng(0)
    a = mx.array(rng.standard_normal((10, 6)).astype(np.float32)).astype(mx.bfloat16)
    b = mx.array(rng.integers(0, 2**32, (4, 3), dtype=np.uint32))
    c = mx.array(rng.standard_normal((5,)).astype(np.float32))
    path = tmp_path / "x.safetensors"
    w = ShardWriter(path, [("a", (10, 6), "BF16"), ("b", (4, 3), "U32"), ("c", (5,), "F32")])
    # Chunks in any order.
    w.write("b", 0, as_bytes(b))
    w.write("a", 7, as_bytes(a[7:]))
    w.write("c", 0, as_bytes(c))
    w.write("a", 0, as_bytes(a[:7]))
    w.close()
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 8 == 0
    back = mx.load(str(path))
    assert mx.array_equal(back["a"], a).item() and back["a"].dtype == mx.bfloat16
    assert mx.array_equal(back["b"], b).item() and mx.array_equal(back["c"], c).item()
    theirs = load_file(str(path))  # the reference implementation reads it too
    np.testing.assert_array_equal(theirs["c"].numpy(), np.array(c))
    np.testing.assert_array_equal(
        theirs["a"].to(torch.float32).numpy(), np.array(a.astype(mx.float32))
    )
    infos, meta = read_header(path)
    assert meta == {"format": "mlx"} and infos["a"].shape == (10, 6)
    assert mx.array_equal(read_rows(infos["a"], 3, 9), a[3:9]).item()


def test_unfinished_shard_is_a_bug_not_a_silent_hole(tmp_path):
    w = ShardWriter(tmp_path / "x.safetensors", [("a", (2, 2), "F32")])
    w.write("a", 0, as_bytes(mx.zeros((1, 2))))
    with pytest.raises(RuntimeError, match="not completely written"):
        w.close()


def test_damaged_headers_are_reported_with_the_file(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(ModelError, match="short.safetensors is truncated"):
        read_header(short)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ModelError, match="damaged header"):
        read_header(garbage)
    cut = tmp_path / "cut.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    cut.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)
    with pytest.raises(ModelError, match="tensor w ends at byte"):
        read_header(cut)
