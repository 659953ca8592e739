"""``hf2q convert``: fetch a Hugging Face checkpoint and quantize it to an MLX folder.

Thin: maps flags onto :class:`hf2q.convert.ConvertOptions`, calls :func:`hf2q.convert.convert`
with progress bars, and prints the summary (Rich on a terminal, plain lines otherwise, one JSON
object with ``--json``). Nothing here imports MLX until the command runs.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from hf2q.errors import UsageError

_STAGES = {
    "fetch": "resolving the source",
    "plan": "planning",
    "write": "writing tensors",
    "evaluate": "checking quality (KL, top-1 against the unquantized model)",
    "finish": "finishing",
}


def _recipe_help() -> str:
    from hf2q.convert.recipes import available_recipes

    names = ", ".join(available_recipes()) or "none"
    return f"Mixed-precision recipe: a shipped name ({names}) or a .toml file."


def convert(
    source: Annotated[
        str, typer.Argument(help="Local checkpoint folder or Hugging Face repo id (owner/name).")
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Folder to create (refused if it exists).")
    ],
    q_bits: Annotated[
        int | None,
        typer.Option("--q-bits", help="Bits per weight: 2, 3, 4, 5, 6, 8 (affine; default 4)."),
    ] = None,
    q_group_size: Annotated[
        int | None,
        typer.Option(
            "--q-group-size",
            help="Weights per scale: 32, 64, 128 (affine; default 64). mx/nv modes fix their own.",
        ),
    ] = None,
    q_mode: Annotated[
        str | None,
        typer.Option(
            "--q-mode",
            help="affine (default), mxfp4 (4-bit, group 32), nvfp4 (4-bit, group 16), mxfp8 (8-bit, group 32).",
        ),
    ] = None,
    recipe: Annotated[str | None, typer.Option("--recipe", help=_recipe_help())] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="float16, bfloat16 or float32 for unquantized tensors (default: the source's).",
        ),
    ] = None,
    quantize: Annotated[
        bool,
        typer.Option("--quantize/--no-quantize", help="--no-quantize writes float weights only."),
    ] = True,
    drop_mtp: Annotated[
        bool,
        typer.Option(
            "--drop-mtp",
            help="Drop the multi-token-prediction head instead of keeping it in mtp.safetensors.",
        ),
    ] = False,
    evaluate: Annotated[
        bool,
        typer.Option("--eval/--no-eval", help="Measure KL and top-1 agreement after converting."),
    ] = True,
    eval_tokens: Annotated[
        int | None,
        typer.Option(
            "--eval-tokens",
            help="Positions compared by the quality check (default 64; fewer for big models on CPU).",
        ),
    ] = None,
    revision: Annotated[
        str | None, typer.Option("--revision", help="Branch, tag or commit of a Hub repo.")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", help="Hugging Face token (default: HF_TOKEN or 'hf auth login')."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
    shard_size: Annotated[
        float, typer.Option("--shard-size", help="Maximum size of one weight file, in GB.")
    ] = 5.0,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            help="Quantization processes (default: one per core on MLX's CPU backend, 0 on a GPU).",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on the last line.")
    ] = False,
) -> None:
    """Quantize a checkpoint to MLX: Qwen3.5 / Qwen3.6 (dense, MoE), Qwen3, DFlash drafters.

    The output opens with stock mlx_lm.load(OUT) (drafters: z-lab's layout). It is written into
    a hidden sibling and renamed at the end, so a failed or interrupted run leaves no OUT.

    Examples:
      [bold]hf2q convert Qwen/Qwen3.5-4B -o qwen3.5-4b-4bit[/bold]
      [bold]hf2q convert ./ckpt -o out --recipe mixed-4-6[/bold]
      [bold]hf2q convert z-lab/Qwen3.5-4B-DFlash -o drafter-8bit --q-bits 8[/bold]
    """
    from hf2q.cli import console
    from hf2q.convert import ConvertOptions
    from hf2q.convert import convert as run_convert

    if shard_size <= 0:
        raise UsageError(f"--shard-size must be positive, not {shard_size}: pass a size in GB")
    options = ConvertOptions(
        quantize=quantize,
        bits=q_bits,
        group_size=q_group_size,
        mode=q_mode,
        recipe=recipe,
        dtype=dtype,
        keep_mtp=not drop_mtp,
        evaluate=evaluate,
        revision=revision,
        token=token,
        force=force,
        shard_bytes=int(shard_size * (1 << 30)),
        workers=workers,
        eval_tokens=eval_tokens,
    )

    def on_stage(name: str) -> None:
        if console.err.is_terminal and not json_out:
            console.err.print(f"[dim]{_STAGES.get(name, name)}...[/dim]")

    with (
        _sigterm_as_interrupt(),
        console.hub_download_progress() as tqdm_class,
        console.progress_bar("converting") as update,
    ):
        result = run_convert(
            source,
            output,
            options,
            on_stage=on_stage,
            on_progress=update,
            tqdm_class=tqdm_class,
        )
    for message in result.warnings:
        console.warn(message)
    if json_out:
        console.emit_json(result.as_dict())
    else:
        console.print_kv(f"hf2q convert: {result.output}", _summary(result.as_dict()))


def _summary(r: dict[str, Any]) -> dict[str, str]:
    """The human summary: sizes, bits per weight, precisions, time, quality."""
    rows = {
        "source": f"{r['source']} ({r['architecture']}, {r['model_type']})",
        "output": r["output"],
        "quantization": _quant_label(r),
        "size": f"{_size(r['source_bytes'])} -> {_size(r['output_bytes'])} "
        f"({r['output_bytes'] / max(1, r['source_bytes']):.2f}x)",
        "bits per weight": f"{r['bits_per_weight']:.3f} ({r['parameters']:,} weights)",
        "tensors": ", ".join(f"{k}: {v}" for k, v in r["precisions"].items()),
        "mtp head": r["mtp"],
    }
    if r["vision_tensors_dropped"]:
        rows["vision tower"] = f"dropped ({r['vision_tensors_dropped']} tensors)"
    rows["time"] = (
        f"{r['time_s']:.2f} s (writing {r['write_s']:.2f} s, quality check {r['eval_s']:.2f} s)"
    )
    ev = r.get("eval") or {}
    if "kl_mean" in ev:
        rows["quality"] = (
            f"KL {ev['kl_mean']:.4f} mean / {ev['kl_max']:.4f} max, top-1 agreement "
            f"{ev['top1_agreement']:.1%} over {ev['tokens']} tokens"
        )
    if "weight_rel_error_mean" in ev:
        rows["weight error"] = (
            f"{ev['weight_rel_error_mean']:.2%} mean / {ev['weight_rel_error_max']:.2%} max (relative RMS)"
        )
    if r.get("eval_skipped"):
        rows["quality check"] = f"skipped: {r['eval_skipped']}"
    workers = f" (with {r['workers']} quantization workers)" if r["workers"] else ""
    rows["peak memory"] = f"{r['peak_rss_mb']:.0f} MB RSS{workers}"
    return rows


def _size(n: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.0f} KB"


def _quant_label(r: dict[str, Any]) -> str:
    q = r.get("quantization")
    if not q:
        return f"none ({r.get('dtype') or 'source dtype'})"
    mode = q.get("mode", "affine")
    body = f"{q['bits']}-bit g{q['group_size']}" if mode == "affine" else mode
    overrides = sum(1 for v in q.values() if isinstance(v, dict))
    text = f"{mode} {body}" if mode == "affine" else body
    if r.get("recipe"):
        text += f", recipe {r['recipe']}"
    if overrides:
        text += f" ({overrides} modules at other settings)"
    return text


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while converting, so the partial output is cleaned up."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
