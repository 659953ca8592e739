"""``hf2q train-draft``: train a DFlash drafter for a target on MLX.

Thin: parses options into :class:`hf2q.train.trainer.TrainDraftConfig`, runs
:func:`hf2q.train.trainer.train_draft` and renders its events (a Rich progress bar with loss,
weighted accuracy and tau on a terminal; one line per event otherwise; ``--json`` adds one JSON
summary on the last line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from hf2q.cli.options import DtypeOption
from hf2q.errors import UsageError


def _ids(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        ids = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(
            f"--target-layer-ids takes comma-separated layer numbers like 1,4,7, got {value!r}"
        ) from None
    if not ids:
        raise UsageError("--target-layer-ids is empty: list target layers like 1,4,7")
    return ids


def train_draft(
    target: Annotated[
        str,
        typer.Option(
            "--target", "-t", help="Target model folder (raw Hugging Face or converted) or Hub id."
        ),
    ],
    data: Annotated[
        list[str],
        typer.Option(
            "--data",
            help="Training data: text files, folders, or JSONL ({'text'} or {'messages'}). Repeat.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for the drafter.")],
    layers: Annotated[
        int | None,
        typer.Option("--layers", help="Drafter layers (default: about target layers / 6, 1..8)."),
    ] = None,
    block_size: Annotated[int, typer.Option("--block-size", help="Block size B.")] = 16,
    target_layer_ids: Annotated[
        str | None,
        typer.Option(
            "--target-layer-ids",
            help="Target layers whose outputs feed the drafter, e.g. 1,4,7 "
            "(default: evenly spaced from 1 to N-3, one per drafter layer).",
        ),
    ] = None,
    mask_token_id: Annotated[
        int | None,
        typer.Option(
            "--mask-token-id",
            help="Embedding row used as MASK (default: the first row no token maps to).",
        ),
    ] = None,
    anchors_per_seq: Annotated[
        int, typer.Option("--anchors-per-seq", help="Blocks sampled per training sequence.")
    ] = 64,
    gamma: Annotated[
        float | None,
        typer.Option(
            "--gamma",
            help="Loss decay exp(-(k-1)/gamma) (default 1 + 3B/8: 7 for B=16, 4 for B=8).",
        ),
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per training sequence.")] = 512,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 8,
    steps: Annotated[int | None, typer.Option("--steps", help="Training steps.")] = None,
    epochs: Annotated[
        float | None, typer.Option("--epochs", help="Passes over the data (default 1).")
    ] = None,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW).")] = 6e-4,
    warmup: Annotated[
        float, typer.Option("--warmup", help="Linear warmup, as a fraction of the steps.")
    ] = 0.04,
    clip: Annotated[float, typer.Option("--clip", help="Gradient norm clipping.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of data order, anchors, init.")] = 0,
    eval_every: Annotated[
        int,
        typer.Option("--eval-every", help="Measure tau every this many steps (and at the end)."),
    ] = 200,
    eval_data: Annotated[
        list[str] | None,
        typer.Option(
            "--eval-data", help="Held-out prompts' source (default: held out from --data)."
        ),
    ] = None,
    eval_prompts: Annotated[
        int, typer.Option("--eval-prompts", help="Prompts per tau measurement (0: none).")
    ] = 8,
    eval_prompt_tokens: Annotated[
        int, typer.Option("--eval-prompt-tokens", help="Prompt length for raw-text eval prompts.")
    ] = 64,
    eval_max_tokens: Annotated[
        int, typer.Option("--eval-max-tokens", help="Tokens generated per eval prompt.")
    ] = 64,
    max_seqs: Annotated[
        int | None,
        typer.Option(
            "--max-seqs", help="Use at most this many training sequences (a seeded sample)."
        ),
    ] = None,
    regenerate: Annotated[
        bool,
        typer.Option(
            "--regenerate/--no-regenerate",
            help="Replace responses by the target's own generations first (recommended).",
        ),
    ] = False,
    regen_prompt_tokens: Annotated[
        int,
        typer.Option("--regen-prompt-tokens", help="Raw text: prompt kept before regenerating."),
    ] = 64,
    regen_temp: Annotated[
        float, typer.Option("--regen-temp", help="Temperature of regeneration (0 = greedy).")
    ] = 0.0,
    regen_batch: Annotated[
        int,
        typer.Option(
            "--regen-batch", help="Prompts regenerated together (MLX CUDA 0.32: 64 or fewer)."
        ),
    ] = 32,
    init: Annotated[
        str,
        typer.Option(
            "--init", help="'random', or 'target': MLPs and norms from the target's last layers."
        ),
    ] = "random",
    feature_cache_gb: Annotated[
        float,
        typer.Option(
            "--feature-cache-gb",
            help="Compute each sequence's target features once when they fit in this much memory.",
        ),
    ] = 2.0,
    max_minutes: Annotated[
        float | None,
        typer.Option(
            "--max-minutes",
            help="Stop training after this many minutes of training steps (then evaluate and save); "
            "the learning-rate schedule still follows --steps/--epochs.",
        ),
    ] = None,
    thinking: Annotated[
        bool | None,
        typer.Option("--thinking/--no-thinking", help="enable_thinking for chat templates."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from OUT's checkpoint.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty OUT.")] = False,
    dtype: DtypeOption = None,
    save_dtype: Annotated[
        str, typer.Option("--save-dtype", help="bfloat16 (z-lab's), float16 or float32.")
    ] = "bfloat16",
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary as the last line.")
    ] = False,
) -> None:
    """Train a DFlash drafter for a target (frozen) on MLX; write it in z-lab's format.

    Examples:
      [bold]hf2q train-draft -t ./qwen -o ./qwen-dflash --data chats.jsonl --regenerate[/bold]
      [bold]hf2q train-draft -t ./target --data src/ -o ./draft --layers 2 --steps 2000[/bold]
      [bold]hf2q train-draft -t ./target --data src/ -o ./draft --resume[/bold]
    """
    from hf2q.train.trainer import TrainDraftConfig, validate

    cfg = TrainDraftConfig(
        target=target,
        data=list(data),
        out=out,
        layers=layers,
        block_size=block_size,
        target_layer_ids=_ids(target_layer_ids),
        mask_token_id=mask_token_id,
        anchors_per_seq=anchors_per_seq,
        gamma=gamma,
        seq_len=seq_len,
        batch_size=batch_size,
        steps=steps,
        epochs=epochs,
        lr=lr,
        warmup=warmup,
        clip=clip,
        seed=seed,
        eval_every=eval_every,
        eval_data=list(eval_data or []),
        eval_prompts=eval_prompts,
        eval_prompt_tokens=eval_prompt_tokens,
        eval_max_tokens=eval_max_tokens,
        max_seqs=max_seqs,
        regenerate=regenerate,
        regen_prompt_tokens=regen_prompt_tokens,
        regen_temperature=regen_temp,
        regen_batch=regen_batch,
        init=init,
        feature_cache_gb=feature_cache_gb,
        max_minutes=max_minutes,
        thinking=thinking,
        resume=resume,
        force=force,
        save_dtype=save_dtype,
        dtype=dtype,
    )
    validate(cfg)  # cheap checks before MLX is imported
    from hf2q.cli import app as app_module
    from hf2q.cli.console import warn
    from hf2q.platform import blas_hint, ensure_fast_blas

    # May re-execute this process with OpenBLAS preloaded: the CPU's matmuls are ~38x faster.
    plan = ensure_fast_blas(allow_reexec=app_module.STANDALONE)
    if plan.action == "hint" and not json_out:
        warn(blas_hint(plan))
    _run(cfg, json_out)


def _run(cfg: Any, json_out: bool) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from hf2q.cli.console import emit_json, err, is_terminal
    from hf2q.train.trainer import (
        Evaluated,
        Finished,
        Preparing,
        Stage,
        StepDone,
        train_draft,
    )

    live = is_terminal() or err.is_terminal
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
        console=err,
        transient=False,
        disable=not live,
    )
    task = None
    tasks: dict[str, Any] = {}
    last: dict[str, int] = {}
    finished = None
    with progress:
        for ev in train_draft(cfg):
            if isinstance(ev, Stage):
                progress.console.print(f"[cyan]{ev.name}[/cyan] {ev.detail}", soft_wrap=True)
            elif isinstance(ev, Preparing):
                if ev.name not in tasks:
                    tasks[ev.name] = progress.add_task(ev.name, total=ev.total, stats="")
                progress.update(tasks[ev.name], completed=ev.done)
                tenth = max(1, ev.total // 10)
                if not live and (ev.done == ev.total or ev.done // tenth != last.get(ev.name)):
                    last[ev.name] = ev.done // tenth
                    err.print(f"{ev.name} {ev.done}/{ev.total}")
            elif isinstance(ev, StepDone):
                stats = (
                    f"loss {ev.loss:.3f}  acc {ev.accuracy:.3f}  train tau {ev.train_tau:.2f}  "
                    f"lr {ev.lr:.1e}  {ev.blocks_per_s:,.0f} blocks/s"
                )
                if task is None:
                    task = progress.add_task("train", total=ev.total, stats=stats)
                progress.update(task, completed=ev.step, stats=stats)
                if not live:
                    err.print(f"step {ev.step}/{ev.total} {stats} epoch {ev.epoch:.2f}")
            elif isinstance(ev, Evaluated):
                progress.console.print(
                    f"[green]eval[/green] step {ev.step}: tau {ev.tau:.2f}, acceptance rate "
                    f"{ev.acceptance_rate:.3f} ({ev.rounds} rounds, {ev.prompts} prompts, "
                    f"{ev.generated_tokens} tokens, {ev.seconds:.1f} s; real DFlash loop, greedy)",
                    soft_wrap=True,
                )
            elif isinstance(ev, Finished):
                finished = ev
    if finished is None:  # pragma: no cover - the generator always ends with Finished
        return
    evals = finished.log.get("evals") or []
    last = evals[-1] if evals else {}
    summary = {
        "out": str(finished.out),
        "steps": finished.steps,
        "tau": last.get("tau"),
        "acceptance_rate": last.get("acceptance_rate"),
        "tau_untrained": evals[0]["tau"] if evals and evals[0]["step"] == 0 else None,
        "loss": (finished.log.get("history") or [{}])[-1].get("loss"),
        "wall_s": finished.log.get("wall_s"),
        "train_s": finished.log.get("train_s"),
    }
    err.print(
        f"[bold]saved[/bold] {finished.out} after {finished.steps} steps"
        + (f": tau {summary['tau']:.2f}" if summary["tau"] is not None else ""),
        soft_wrap=True,
    )
    if json_out:
        emit_json(summary)


def register(app: typer.Typer) -> None:
    app.command("train-draft")(train_draft)
