"""Plan a conversion: which tensors to write, in which precision, into which file — before any data moves.

What it does: read the checkpoint's config and safetensors headers, recognise the kind (a Qwen3.5
/ Qwen3.6 / Qwen3 target or a z-lab DFlash drafter), build the mlx-lm (or drafter) model lazily
(no weights are materialised) to learn its module tree, quantization predicate and cast rules,
run mlx-lm's own ``sanitize`` over the lazily loaded weights (shapes only: nothing is read), then
decide for every output parameter its input, its cast and its quantization, and lay the output
tensors out into shards. Tensors that ``sanitize`` passes through unchanged keep a pointer to
their bytes on disk, so they can later be streamed in row chunks.

What it does not do: read tensor data or write anything (see ``hf2q.convert.quantize``).
"""

from __future__ import annotations

import copy
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf2q.convert.recipes import Policy, QuantSpec, Recipe
from hf2q.convert.safetensors_io import TensorInfo, read_header
from hf2q.errors import ModelError, UsageError
from hf2q.loading import (
    is_drafter_config,
    normalize_config,
    read_config,
    stack_experts,
    weight_files,
)

#: Float dtypes hf2q writes for unquantized tensors.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")

_VISION = re.compile(r"^(model\.visual|visual|vision_tower|model\.vision_tower)\.")
_SIZES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass
class Input:
    """Where an output parameter's values come from, before cast/quantization."""

    shape: tuple[int, ...]
    dtype: Any  # mx.Dtype
    info: TensorInfo | None = None  # bytes on disk, unchanged by sanitize: streamable by rows
    array: Any = None  # otherwise: a lazy MLX array (materialised when its job runs)
    group: str = ""  # lazy inputs sharing a group are materialised together

    @property
    def rows(self) -> int:
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n if len(self.shape) > 1 else 1

    @property
    def nbytes(self) -> int:
        n = self.dtype.size
        for d in self.shape:
            n *= d
        return n


@dataclass
class Job:
    """Produce one output parameter: cast (and maybe quantize) ``input`` into ``outputs``."""

    name: (
        str  # parameter name in the model, e.g. "language_model.model.layers.0.mlp.up_proj.weight"
    )
    input: Input
    out_dtype: Any  # mx.Dtype to cast floats to, or None to keep the input dtype
    spec: QuantSpec | None = None  # quantize (weight of a quantizable module) when set
    outputs: list[str] = field(default_factory=list)  # tensor names written
    file: str = "model"  # "model" (mlx-lm weights) or "mtp" (kept aside)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


@dataclass
class OutTensor:
    """One stored output tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors tag
    nbytes: int


@dataclass
class Plan:
    """Everything a conversion will do, decided up front."""

    folder: Path
    kind: str  # "target" or "drafter"
    model_type: str
    architecture: str
    model: Any  # the lazily built mlx-lm / drafter model (module tree; parameters never evaluated)
    raw_config: dict[str, Any]
    config: dict[str, Any]  # config.json to write
    jobs: list[Job]
    tensors: dict[str, OutTensor]  # model weights, in write order
    mtp_tensors: dict[str, OutTensor]
    shards: list[list[str]]
    quantization: dict[str, Any] | None
    out_dtype: str | None
    source_bytes: int
    num_layers: int
    precision_counts: dict[str, int]
    params: int  # number of weights of the model (quantized ones counted unpacked)
    weight_bytes: int  # bytes of the model weights as written
    vision_dropped: int
    mtp_count: int
    keep_mtp: bool
    recipe: Recipe | None = None

    @property
    def bits_per_weight(self) -> float:
        return self.weight_bytes * 8 / self.params if self.params else 0.0

    @property
    def output_bytes(self) -> int:
        return self.weight_bytes + sum(t.nbytes for t in self.mtp_tensors.values())


def source_dtype(cfg: dict[str, Any]) -> str | None:
    """The float dtype a checkpoint's config declares (``dtype`` / ``torch_dtype``), if any."""
    for holder in (cfg, cfg.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = holder.get(key)
            if isinstance(value, str) and value in FLOAT_DTYPES:
                return value
    return None


def _check_not_quantized(folder: Path, cfg: dict[str, Any]) -> None:
    for holder in (cfg, cfg.get("text_config") or {}):
        q = holder.get("quantization") or holder.get("quantization_config")
        if q:
            method = q.get("quant_method") or q.get("mode") or f"{q.get('bits', '?')}-bit"
            raise ModelError(
                f"{folder} is already quantized ({method}): hf2q converts float checkpoints, "
                "pass the original bf16/fp16/fp32 checkpoint"
            )


def read_source(folder: Path) -> tuple[dict[str, Any], list[Path], dict[str, TensorInfo]]:
    """Config, weight files and the tensors their headers list (data untouched)."""
    raw = read_config(folder)
    files = weight_files(folder)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        found, _ = read_header(f)
        tensors.update(found)
    return raw, files, tensors


def build_plan(
    folder: Path,
    *,
    policy_default: QuantSpec | None,
    recipe: Recipe | None = None,
    dtype: str | None = None,
    keep_mtp: bool = True,
    shard_bytes: int = 5 << 30,
) -> Plan:
    """Decide the whole conversion of the checkpoint in ``folder``.

    Args:
        policy_default: the body's quantization (None: write everything in float).
        recipe: per-path rules on top of ``policy_default``.
        dtype: float dtype for unquantized tensors (None: the config's, else each tensor's own).
        keep_mtp: write ``mtp.*`` tensors to ``mtp.safetensors`` (False: drop them).
        shard_bytes: maximum bytes of weights per output shard (a bigger single tensor gets its own).

    Raises:
        ModelError: unsupported architecture, inconsistent or damaged checkpoint.
        UsageError: a recipe that asks for settings MLX cannot do.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    raw, files, infos = read_source(folder)
    _check_not_quantized(folder, raw)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise UsageError(f"unknown --dtype {dtype!r}: use one of {', '.join(FLOAT_DTYPES)}")
    drafter = is_drafter_config(raw)
    if drafter:
        from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel

        dcfg = DFlashConfig.from_dict(raw, where=f"drafter {folder}")
        model = DFlashDraftModel(dcfg)
        config = dict(raw)
        model_type = "dflash"
        num_layers = dcfg.num_hidden_layers
        sanitize = None
        cast_predicate = None
        model_predicate = None
    else:
        config = normalize_config(raw)
        model_type = config["model_type"]
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
        try:
            model = arch.Model(arch.ModelArgs.from_dict(config))
        except (TypeError, ValueError, KeyError) as exc:
            raise ModelError(
                f"{folder}/config.json does not describe a valid {model_type} model ({exc}): fix or re-download it"
            ) from exc
        text = config.get("text_config") or config
        num_layers = int(text.get("num_hidden_layers", 0))
        sanitize = getattr(model, "sanitize", None)
        cast_predicate = getattr(model, "cast_predicate", None)
        model_predicate = getattr(model, "quant_predicate", None)
    architecture = str((raw.get("architectures") or [model_type])[0])

    out_dtype = dtype or source_dtype(raw)
    out_mx = getattr(mx, out_dtype) if out_dtype else None
    policy = Policy(
        policy_default,
        recipe=recipe,
        model_predicate=model_predicate,
        num_layers=num_layers,
    )

    # Lazily loaded weights (mx.load reads headers only), split into what mlx-lm reads, MTP, vision.
    lazy: dict[str, Any] = {}
    for f in files:
        try:
            lazy.update(mx.load(str(f)))
        except Exception as exc:  # MLX raises RuntimeError / ValueError on damaged files
            raise ModelError(f"{f} cannot be read ({exc}): re-download it") from exc
    mtp = {k: v for k, v in lazy.items() if "mtp." in k}
    vision = [k for k in lazy if _VISION.match(k)]
    body = {k: v for k, v in lazy.items() if k not in mtp}
    # Tensors sanitize passes through unchanged are recognised by identity; ``lazy`` keeps every
    # original array alive until the jobs are built, so no id can be reused meanwhile.
    by_id = {id(v): infos[k] for k, v in body.items() if k in infos}
    if not drafter:
        body = stack_experts(body)
    if sanitize is not None:
        try:
            body = sanitize(body)
        except (KeyError, ValueError, IndexError) as exc:
            raise ModelError(
                f"{folder}'s weights do not fit its config.json ({type(exc).__name__}: {exc}): the checkpoint is inconsistent or damaged"
            ) from exc

    expected = dict(tree_flatten(model.parameters()))
    _check_names(folder, body, expected)
    modules = dict(model.named_modules())

    jobs: list[Job] = []
    tensors: dict[str, OutTensor] = {}
    counts: dict[str, int] = {}
    quant_paths: dict[str, dict[str, Any]] = {}
    params = 0
    weight_bytes = 0
    for name in _ordered(body):
        value = body[name]
        info = by_id.get(id(value))
        if info is not None and not info.readable:
            info = None
        inp = Input(
            shape=tuple(value.shape),
            dtype=value.dtype,
            info=info,
            array=None if info is not None else value,
            group=_group_of(name),
        )
        module_path, _, leaf = name.rpartition(".")
        module = modules.get(module_path)
        floating = mx.issubdtype(value.dtype, mx.floating)
        cast_to = out_mx if floating and (cast_predicate is None or cast_predicate(name)) else None
        spec = None
        if leaf == "weight" and module is not None and hasattr(module, "to_quantized"):
            spec = policy.decide(module_path, module)
            if spec is not None and value.shape[-1] % spec.group_size != 0:
                spec = None  # as mlx-lm: a row that does not split into groups stays in float
            if spec is not None and not floating:
                spec = None
        job = Job(name=name, input=inp, out_dtype=cast_to, spec=spec)
        stored_dtype = cast_to if cast_to is not None else value.dtype
        n_weights = _numel(value.shape)
        params += n_weights
        if spec is None:
            t = _out(name, value.shape, stored_dtype)
            job.outputs = [name]
            tensors[name] = t
            weight_bytes += t.nbytes
            label = _dtype_name(stored_dtype)
        else:
            stem = name[: -len(".weight")]
            lead, cols = tuple(value.shape[:-1]), value.shape[-1]
            outs = [_out(f"{stem}.weight", (*lead, cols * spec.bits // 32), mx.uint32)]
            scale_dtype = stored_dtype if spec.mode == "affine" else mx.uint8
            outs.append(_out(f"{stem}.scales", (*lead, cols // spec.group_size), scale_dtype))
            if spec.mode == "affine":
                outs.append(_out(f"{stem}.biases", (*lead, cols // spec.group_size), scale_dtype))
            for t in outs:
                tensors[t.name] = t
                weight_bytes += t.nbytes
            job.outputs = [t.name for t in outs]
            label = spec.label
            if policy_default is None or spec != policy_default:
                quant_paths[stem] = spec.as_dict()
        counts[label] = counts.get(label, 0) + 1
        jobs.append(job)

    mtp_tensors: dict[str, OutTensor] = {}
    if keep_mtp:
        for name in sorted(mtp):
            value = mtp[name]
            info = infos.get(name)
            floating = mx.issubdtype(value.dtype, mx.floating)
            cast_to = out_mx if floating else None
            stored = cast_to if cast_to is not None else value.dtype
            inp = Input(
                shape=tuple(value.shape),
                dtype=value.dtype,
                info=info if info is not None and info.readable else None,
                array=None if info is not None and info.readable else value,
            )
            jobs.append(Job(name=name, input=inp, out_dtype=cast_to, outputs=[name], file="mtp"))
            mtp_tensors[name] = _out(name, value.shape, stored)

    del lazy
    quantization = None
    if any(j.spec is not None for j in jobs):
        assert policy_default is not None
        quantization = {**policy_default.as_dict(), **quant_paths}
    config_out = _output_config(config if not drafter else raw, quantization, out_dtype, drafter)
    return Plan(
        folder=folder,
        kind="drafter" if drafter else "target",
        model_type=model_type,
        architecture=architecture,
        model=model,
        raw_config=raw,
        config=config_out,
        jobs=jobs,
        tensors=tensors,
        mtp_tensors=mtp_tensors,
        shards=_shard(tensors, shard_bytes),
        quantization=quantization,
        out_dtype=out_dtype,
        source_bytes=sum(f.stat().st_size for f in files),
        num_layers=num_layers,
        precision_counts=counts,
        params=params,
        weight_bytes=weight_bytes,
        vision_dropped=len(vision),
        mtp_count=len(mtp),
        keep_mtp=keep_mtp,
        recipe=recipe,
    )


def _check_names(folder: Path, weights: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse weights that mlx-lm's strict loading would refuse, before anything is written."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(
            f"{folder} lacks weight {missing[0]}{more} that its config.json requires: the "
            "checkpoint is incomplete or does not match its config"
        )
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ModelError(
            f"{folder} has weight {extra[0]}{more} that its config.json does not describe: the "
            "checkpoint does not match its config"
        )
    for name, value in weights.items():
        want = tuple(expected[name].shape)
        if tuple(value.shape) != want:
            raise ModelError(
                f"{folder}: weight {name} has shape {tuple(value.shape)} but config.json implies "
                f"{want}: the checkpoint does not match its config"
            )


def _ordered(weights: dict[str, Any]) -> list[str]:
    """Names in a natural order (layer 2 before layer 10), so shards follow the model's layout."""

    def key(name: str) -> list[Any]:
        return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]

    return sorted(weights, key=key)


def _group_of(name: str) -> str:
    # switch_mlp gate/up/down come from one fused source tensor: materialise them together.
    if ".switch_mlp." in name:
        return name.split(".switch_mlp.")[0]
    return name


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dtype_name(dtype: Any) -> str:
    return str(dtype).split(".")[-1]


def _out(name: str, shape: Any, dtype: Any) -> OutTensor:
    from hf2q.convert.safetensors_io import dtype_tag

    shape = tuple(int(d) for d in shape)
    return OutTensor(name, shape, dtype_tag(dtype), _numel(shape) * dtype.size)


def _shard(tensors: dict[str, OutTensor], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        if not shards or (size + t.nbytes > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    return shards or [[]]


def _output_config(
    config: dict[str, Any],
    quantization: dict[str, Any] | None,
    out_dtype: str | None,
    drafter: bool,
) -> dict[str, Any]:
    """config.json of the output: what mlx-lm (or a DFlash loader) reads, plus ``quantization``."""
    cfg = copy.deepcopy({k: v for k, v in config.items() if k != "_name_or_path"})
    if not drafter:
        cfg.pop("vision_config", None)  # the vision tower is not converted
    for holder in (cfg, cfg.get("text_config")):
        if isinstance(holder, dict) and out_dtype:
            for key in ("dtype", "torch_dtype"):
                if key in holder:
                    holder[key] = out_dtype
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    if quantization is not None:
        cfg["quantization"] = quantization
        # mlx-lm writes both keys; tools that follow the Hugging Face tree read the second.
        cfg["quantization_config"] = quantization
    return cfg
