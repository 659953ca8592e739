"""``hf2q convert`` as a library: fetch a checkpoint, quantize it to an MLX format, check its quality.

What it does: :func:`convert` resolves the source (local folder or Hub repo id), plans the
conversion (``plan``), streams the tensors into shards inside a hidden sibling of the output
(``quantize``, ``write``), copies tokenizer files, measures the quality of the quantized model
against the unquantized one (``evaluate``), and renames the sibling into place. The result
describes sizes, bits per weight, precisions, timings and quality; nothing is printed.

What it does not do: print or parse command lines (``hf2q.cli.convert``).

Output layout (targets): ``config.json`` (mlx-lm model type, ``quantization`` and
``quantization_config``), ``model[-0000i-of-0000n].safetensors`` with mlx-lm's sanitized names,
``model.safetensors.index.json``, the source's tokenizer / chat template / generation config,
``mtp.safetensors`` (the multi-token-prediction head, original names, unquantized; mlx-lm does not
read it) unless dropped, and ``hf2q.json`` (what was done). Vision tower weights are dropped.
Drafters keep z-lab's layout and tensor names.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hf2q.convert.recipes import QuantSpec, load_recipe, make_spec
from hf2q.errors import UsageError

#: ``on_stage(name)``: "fetch", "plan", "write", "evaluate", "finish".
StageFn = Callable[[str], None]


@dataclass
class ConvertOptions:
    """What to do; the CLI maps its flags onto these fields one to one."""

    quantize: bool = True
    bits: int | None = None
    group_size: int | None = None
    mode: str | None = None
    recipe: str | None = None
    dtype: str | None = None
    keep_mtp: bool = True
    evaluate: bool = True
    revision: str | None = None
    token: str | None = None
    force: bool = False
    shard_bytes: int = 5 << 30
    chunk_bytes: int = 32 << 20
    eval_tokens: int | None = None  # positions of the quality check; None: up to 64, fewer
    # for big models on MLX's CPU backend (see hf2q.convert.evaluate.eval_tokens)
    workers: int | None = None  # quantization processes; None: one per core on CPU, 0 on GPU


@dataclass
class ConvertResult:
    """What a conversion did (the CLI's summary and ``--json`` object)."""

    source: str
    source_path: str
    output: str
    kind: str
    model_type: str
    architecture: str
    quantization: dict[str, Any] | None
    recipe: str | None
    dtype: str | None
    source_bytes: int
    output_bytes: int
    parameters: int
    bits_per_weight: float
    precisions: dict[str, int]
    files: list[str]
    mtp: str
    vision_tensors_dropped: int
    time_s: float
    write_s: float
    eval_s: float
    peak_rss_mb: float  # this process plus its quantization workers (each at its own peak)
    workers: int
    eval: dict[str, Any] | None = None
    eval_skipped: str | None = None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_quantization(options: ConvertOptions) -> tuple[QuantSpec | None, Any]:
    """The body's quantization and the recipe, from options (CLI flags override a recipe's default)."""
    if not options.quantize:
        given = [
            flag
            for flag, value in (
                ("--q-bits", options.bits),
                ("--q-group-size", options.group_size),
                ("--q-mode", options.mode),
                ("--recipe", options.recipe),
            )
            if value is not None
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} cannot be combined with --no-quantize: drop one of them"
            )
        return None, None
    recipe = load_recipe(options.recipe) if options.recipe else None
    base = dict(recipe.default) if recipe is not None else {}
    mode = options.mode or base.get("mode")
    same_mode = mode == base.get("mode", "affine")
    bits = options.bits if options.bits is not None else (base.get("bits") if same_mode else None)
    group = (
        options.group_size
        if options.group_size is not None
        else (base.get("group_size") if same_mode else None)
    )
    where = f"recipe {recipe.name} with the --q-* flags" if recipe is not None else ""
    return make_spec(bits, group, mode, where=where), recipe


def convert(
    source: str | Path,
    output: str | Path,
    options: ConvertOptions | None = None,
    *,
    on_stage: StageFn | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    tqdm_class: Any = None,
) -> ConvertResult:
    """Convert ``source`` into an MLX folder at ``output``; see the module docstring.

    Args:
        source: local checkpoint folder or Hugging Face repo id.
        output: folder to create (refused if it exists, unless ``options.force``).
        on_stage: called when a stage starts.
        on_progress: ``(done_bytes, total_bytes)`` while tensors are written.
        tqdm_class: progress bar class for Hub downloads (huggingface_hub's ``tqdm_class``).

    Raises:
        Hf2qError: any problem the user can fix, with a one-line message naming the fix.
    """
    from hf2q.convert.plan import build_plan
    from hf2q.convert.quantize import write_weights
    from hf2q.convert.workers import default_workers
    from hf2q.convert.write import (
        check_output,
        check_space,
        copy_side_files,
        staging,
        write_index,
        write_json,
    )
    from hf2q.hub import resolve_source

    options = options or ConvertOptions()
    stage = on_stage or (lambda _name: None)
    started = time.perf_counter()
    default, recipe = resolve_quantization(options)
    out = Path(output).expanduser()
    text = str(source)
    _check_options(options, text)

    stage("fetch")
    folder = resolve_source(
        text,
        revision=options.revision,
        token=options.token,
        tqdm_class=tqdm_class,
        progress=tqdm_class is not None,
    )
    check_output(out, folder, force=options.force)
    n_workers = options.workers
    if n_workers is None:
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        n_workers = default_workers() if size >= PARALLEL_MIN_BYTES else 0

    # Workers start before planning, so their start-up overlaps importing mlx-lm.
    with _worker_pool(n_workers) as pool:
        stage("plan")
        plan = build_plan(
            folder,
            policy_default=default,
            recipe=recipe,
            dtype=options.dtype,
            keep_mtp=options.keep_mtp,
            shard_bytes=options.shard_bytes,
        )
        check_space(out, plan.output_bytes)
        with staging(out, force=options.force) as temp:
            stage("write")
            t = time.perf_counter()
            stats = write_weights(
                plan,
                temp,
                chunk_bytes=options.chunk_bytes,
                measure_error=options.evaluate and plan.quantization is not None,
                progress=on_progress,
                workers=pool if pool is not None else 0,
            )
            write_json(temp / "config.json", plan.config)
            write_index(temp, stats.files, total_size=plan.weight_bytes, params=plan.params)
            copied = copy_side_files(folder, temp)
            write_s = time.perf_counter() - t

            warnings = []
            has_tokenizer = any(n.startswith("tokenizer") or n == "vocab.json" for n in copied)
            if plan.kind == "target" and not has_tokenizer:
                warnings.append(
                    f"{folder} has no tokenizer files, so mlx_lm.load cannot open the output "
                    "until tokenizer.json / tokenizer_config.json are copied next to its config.json"
                )
            t = time.perf_counter()
            quality, skipped = _quality(plan, folder, temp, options, stats, has_tokenizer, stage)
            eval_s = time.perf_counter() - t if quality and "kl_mean" in quality else 0.0

            stage("finish")
            result = ConvertResult(
                source=text,
                source_path=str(folder),
                output=str(out),
                kind=plan.kind,
                model_type=plan.model_type,
                architecture=plan.architecture,
                quantization=plan.quantization,
                recipe=recipe.name if recipe is not None else None,
                dtype=plan.out_dtype,
                source_bytes=plan.source_bytes,
                output_bytes=sum(p.stat().st_size for p in temp.iterdir() if p.is_file()),
                parameters=plan.params,
                bits_per_weight=round(plan.bits_per_weight, 4),
                precisions=dict(sorted(plan.precision_counts.items())),
                files=sorted([p.name for p in temp.iterdir()] + ["hf2q.json"]),
                mtp=_mtp_note(plan),
                vision_tensors_dropped=plan.vision_dropped,
                time_s=round(time.perf_counter() - started, 3),
                write_s=round(write_s, 3),
                eval_s=round(eval_s, 3),
                peak_rss_mb=round(_peak_rss_mb() + stats.worker_peak_rss_mb, 1),
                workers=len(pool) if pool is not None else 0,
                eval=quality,
                eval_skipped=skipped,
                warnings=warnings,
            )
            provenance = result.as_dict() | {
                "hf2q_version": _version(),
                "options": _options(options),
            }
            write_json(temp / "hf2q.json", provenance)
    return result


def _check_options(options: ConvertOptions, source: str) -> None:
    if options.revision is not None and Path(source).expanduser().exists():
        raise UsageError(
            f"--revision applies to Hub repo ids, but {source} is a local folder: drop --revision"
        )
    if options.workers is not None and options.workers < 0:
        raise UsageError(f"--workers must be 0 or more, not {options.workers}")
    if options.eval_tokens is not None and options.eval_tokens < 2:
        raise UsageError(f"--eval-tokens must be at least 2, not {options.eval_tokens}")


#: FLOPs one forward pass of the quality check may take on MLX's CPU backend (a few seconds).
CPU_EVAL_FLOPS = 2e10

#: Below this many bytes of weights, starting worker processes costs more than it saves.
PARALLEL_MIN_BYTES = 256 << 20


@contextlib.contextmanager
def _worker_pool(n: int) -> Iterator[Any]:
    """``n`` quantization processes for the block (None when n is 0); stopped on any exit."""
    from hf2q.convert.workers import WorkerPool

    pool = WorkerPool(n) if n > 0 else None
    try:
        yield pool
    except BaseException:
        if pool is not None:
            pool.close(force=True)
            pool = None
        raise
    finally:
        if pool is not None:
            pool.close()


def _quality(
    plan: Any,
    folder: Path,
    written: Path,
    options: ConvertOptions,
    stats: Any,
    has_tokenizer: bool,
    stage: StageFn,
) -> tuple[dict[str, Any] | None, str | None]:
    """The quality figures (weight error, KL, top-1) and why the KL check was skipped, if it was."""
    info: dict[str, Any] = {}
    if stats.weight_errors:
        errs = list(stats.weight_errors.values())
        info["weight_rel_error_mean"] = sum(errs) / len(errs)
        info["weight_rel_error_max"] = max(errs)
    skipped = None
    if not options.evaluate:
        skipped = "--no-eval"
    elif plan.quantization is None:
        skipped = "nothing was quantized"
    elif plan.kind == "drafter":
        skipped = "a drafter has no next-token distribution of its own (weight error only)"
    elif not has_tokenizer:
        skipped = "no tokenizer in the source"
    else:
        stage("evaluate")
        import mlx.core as mx
        from mlx_lm.utils import load_tokenizer

        from hf2q.convert.evaluate import eval_tokens, evaluate

        tokens = options.eval_tokens
        if tokens is None:
            on_cpu = mx.default_device() == mx.cpu
            tokens = eval_tokens(plan.params, flop_budget=CPU_EVAL_FLOPS if on_cpu else None)
        info.update(evaluate(plan, written, load_tokenizer(folder), max_tokens=tokens).as_dict())
    return (info or None), skipped


def _mtp_note(plan: Any) -> str:
    if plan.mtp_count == 0:
        return "none in the source"
    if plan.keep_mtp:
        return f"kept aside: {plan.mtp_count} tensors in mtp.safetensors (mlx-lm does not read it)"
    return f"dropped: {plan.mtp_count} tensors (--drop-mtp)"


def _peak_rss_mb() -> float:
    try:
        import resource
    except ImportError:  # Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def _version() -> str:
    from hf2q import __version__

    return __version__


def _options(options: ConvertOptions) -> dict[str, Any]:
    data = asdict(options)
    data.pop("token", None)  # never store a secret in the output
    return data
