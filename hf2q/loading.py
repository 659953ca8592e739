"""Load a checkpoint folder (raw Hugging Face or converted by ``hf2q convert``) into mlx-lm's classes.

What it does: read ``config.json`` and the safetensors (index-aware, with errors that name the
broken file), bridge the two places where a checkpoint written by ``transformers`` differs from
what mlx-lm 0.32 reads (text-only ``*_text`` model types, and MoE experts stored one tensor per
expert), then hand over to mlx-lm's own model classes, ``sanitize`` and quantization handling.

What it does not do: implement any architecture or quantize anything (see ``hf2q.convert``).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf2q.errors import ModelError

#: Architectures hf2q handles, by config ``model_type`` (top level or ``text_config``).
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3", "dflash (drafter)")

# transformers writes text-only Qwen3.5 checkpoints with these types; mlx-lm reads the parent type.
_TEXT_ONLY_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}

_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def read_config(folder: Path) -> dict[str, Any]:
    """Parse ``folder/config.json`` or raise :class:`ModelError` naming the fix."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ModelError(
            f"{folder} has no config.json: pass a Hugging Face checkpoint folder (or a Hub repo id)"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(
            f"{cfg_file} is not valid JSON ({exc.msg}, line {exc.lineno}): re-download the checkpoint"
        ) from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_file} is not a JSON object: re-download the checkpoint")
    return cfg


def model_type_of(cfg: dict[str, Any]) -> str:
    """The architecture's ``model_type`` (``""`` when the config names none)."""
    return str(cfg.get("model_type") or (cfg.get("text_config") or {}).get("model_type") or "")


def is_drafter_config(cfg: dict[str, Any]) -> bool:
    archs = [str(a) for a in cfg.get("architectures") or []]
    return "dflash_config" in cfg or any("DFlash" in a for a in archs)


def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of a target config that mlx-lm's ``get_model_classes`` accepts.

    Raises:
        ModelError: the architecture is not one hf2q supports.
    """
    cfg = dict(cfg)
    mtype = str(cfg.get("model_type") or "")
    if mtype in _TEXT_ONLY_TYPES:
        cfg["model_type"] = _TEXT_ONLY_TYPES[mtype]
        mtype = cfg["model_type"]
    if mtype not in ("qwen3_5", "qwen3_5_moe", "qwen3"):
        shown = mtype or "with no model_type"
        raise ModelError(
            f"unsupported architecture {shown} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return cfg


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked against its index when there is one."""
    index_file = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    if index_file is not None:
        try:
            index = json.loads(index_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{index_file} is not valid JSON: re-download the checkpoint") from exc
        names = sorted(set((index.get("weight_map") or {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelError(
                f"{folder} lacks {', '.join(missing)} named in {index_file.name}: the download is "
                "incomplete, fetch the missing shards"
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{folder} has no .safetensors weights: pass a complete checkpoint (pytorch .bin files are not read)"
        )
    return files


def read_safetensors(file: Path) -> dict[str, Any]:
    """Load one safetensors file with MLX (lazily), raising :class:`ModelError` if it is damaged."""
    import mlx.core as mx

    try:
        return mx.load(str(file))
    except Exception as exc:  # MLX raises RuntimeError / ValueError for truncated files
        raise ModelError(
            f"{file} cannot be read ({exc}): the file is damaged or truncated, re-download it"
        ) from exc


def stack_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Fuse per-expert MoE tensors (``experts.E.gate_proj.weight``...) into mlx-lm's stacked form.

    transformers writes one tensor per expert; mlx-lm's ``qwen3_5_moe`` sanitize expects
    ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I). Idempotent.
    """
    import mlx.core as mx

    groups: dict[str, dict[str, dict[int, Any]]] = {}
    rest: dict[str, Any] = {}
    for key, value in weights.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            rest[key] = value
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["e"])] = value
    for prefix, projs in groups.items():
        n = len(projs.get("down_proj", {}))
        if not all(
            sorted(projs.get(p, {})) == list(range(n))
            for p in ("gate_proj", "up_proj", "down_proj")
        ):
            raise ModelError(
                f"{prefix} has an incomplete set of experts: the checkpoint is damaged, re-download it"
            )
        gate = mx.stack([projs["gate_proj"][e] for e in range(n)])
        up = mx.stack([projs["up_proj"][e] for e in range(n)])
        rest[f"{prefix}.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        rest[f"{prefix}.down_proj"] = mx.stack([projs["down_proj"][e] for e in range(n)])
    return rest


@dataclass
class LoadedModel:
    """An mlx-lm model with its tokenizer, normalized config and source folder."""

    model: Any
    tokenizer: Any
    config: dict[str, Any]
    path: Path


def load_model(
    source: str | Path,
    *,
    revision: str | None = None,
    lazy: bool = False,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a target model (raw HF checkpoint, hf2q/mlx-lm converted folder, or Hub repo id).

    Raises:
        SourceError / ModelError: with a one-line message naming the fix.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from hf2q.hub import resolve_source

    folder = resolve_source(source, revision=revision)
    raw = read_config(folder)
    if is_drafter_config(raw):
        raise ModelError(f"{folder} is a DFlash drafter, not a target model: pass it with --draft")
    config = normalize_config(raw)
    weights: dict[str, Any] = {}
    for f in weight_files(folder):
        weights.update(read_safetensors(f))
    weights = stack_experts(weights)

    # Build through mlx-lm's own classes, sanitize and quantization handling.
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if (quant := config.get("quantization")) is not None:
        _quantize_like_mlx_lm(model, quant, config, weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        raise ModelError(
            f"{folder}'s weights do not match its config.json ({first}): the checkpoint is inconsistent or damaged"
        ) from exc
    if not lazy:
        mx.eval(model.parameters())
    tok = None
    if tokenizer:
        eos = raw.get("eos_token_id")
        try:
            tok = load_tokenizer(folder, eos_token_ids=_generation_eos(folder, eos))
        except Exception as exc:
            raise ModelError(
                f"{folder} has no usable tokenizer ({type(exc).__name__}: {exc}): copy the tokenizer files next to config.json"
            ) from exc
    return LoadedModel(model=model, tokenizer=tok, config=config, path=folder)


def _generation_eos(folder: Path, fallback: Any) -> list[int] | None:
    """EOS ids from generation_config.json (Qwen3.5 lists both <|im_end|> and <|endoftext|>)."""
    gen = folder / "generation_config.json"
    ids = fallback
    if gen.is_file():
        try:
            ids = json.loads(gen.read_text()).get("eos_token_id", fallback)
        except json.JSONDecodeError:
            ids = fallback
    if ids is None:
        return None
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _quantize_like_mlx_lm(
    model: Any, quant: dict[str, Any], config: dict[str, Any], weights: dict[str, Any]
) -> None:
    """Swap in quantized layers exactly where the checkpoint stores quantized weights."""
    import mlx.nn as nn

    def predicate(path: str, module: Any) -> Any:
        if path in quant and isinstance(quant[path], dict):
            return quant[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(
        model,
        group_size=quant.get("group_size", 64),
        bits=quant.get("bits", 4),
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )
