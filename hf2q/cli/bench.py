"""``hf2q bench``: batched DFlash against plain batched decoding and sequential DFlash, per slot count.

Thin: validates options, arranges the fast CPU BLAS, loads the pair (``hf2q.runtime.pair``), runs
``hf2q.runtime.bench.run_bench`` and renders its report (``hf2q.cli.bench_view``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hf2q.cli.options import (
    DraftHeadBitsOption,
    DraftOption,
    DraftVocabOption,
    DtypeOption,
    ModelOption,
    check_draft_head_bits,
    check_draft_vocab,
)
from hf2q.errors import OutputError, UsageError


def bench(
    model: ModelOption = None,
    draft: DraftOption = None,
    slots: Annotated[
        str,
        typer.Option(
            "--slots", "-s", help="Slot counts to measure: one value or a list like 1,2,4,8."
        ),
    ] = "1,2,4,8",
    gen_tokens: Annotated[
        int, typer.Option("--gen-tokens", "-n", help="Tokens to generate per request (most).")
    ] = 128,
    prompt_tokens: Annotated[
        int | None,
        typer.Option("--prompt-tokens", help="Prompt length of --workload random (default 128)."),
    ] = None,
    trials: Annotated[
        int,
        typer.Option(
            "--trials",
            help="Measured trials, round-robin over slot counts and modes (trial k of each before"
            " trial k+1); medians with min-max are shown.",
        ),
    ] = 3,
    warmup: Annotated[
        int,
        typer.Option(
            "--warmup", help="Unrecorded runs per slot count and mode, all before the trials."
        ),
    ] = 1,
    block_size: Annotated[
        int | None,
        typer.Option(
            "--block-size", "-b", help="DFlash block size B (2..drafter's; default the drafter's)."
        ),
    ] = None,
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            "-w",
            help="'prompts': the built-in prompt set, EOS honoured; 'random': random prompt "
            "tokens, EOS ignored (every request generates --gen-tokens).",
        ),
    ] = "prompts",
    baseline: Annotated[
        bool,
        typer.Option(
            "--baseline/--no-baseline",
            help="Also measure plain batched decoding and sequential single-slot DFlash.",
        ),
    ] = True,
    requests_per_slot: Annotated[
        int,
        typer.Option(
            "--requests-per-slot",
            help="K: N slots decode K x N requests; K > 1 queues them (continuous batching: a "
            "slot whose request ends takes the next one).",
        ),
    ] = 1,
    lookup: Annotated[
        bool,
        typer.Option(
            "--lookup/--no-lookup",
            help="DFlash rounds may draft by n-gram lookup, as hf2q generate does by default "
            "(--no-lookup: the drafter only).",
        ),
    ] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random workload.")] = 0,
    idle: Annotated[
        str,
        typer.Option(
            "--idle",
            help="Slots left without work: 'compact' (drop their rows) or 'keep' (compute masked rows).",
        ),
    ] = "compact",
    dtype: DtypeOption = None,
    draft_head_bits: DraftHeadBitsOption = 0,
    draft_vocab: DraftVocabOption = 0,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--no-chat",
            help="Apply the chat template to the built-in prompts (default: yes when the model has one).",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (last line) instead of tables.")
    ] = False,
    out_file: Annotated[
        Path | None, typer.Option("--out", "-o", help="Also write the JSON report to this file.")
    ] = None,
    revision: Annotated[
        str | None, typer.Option("--revision", help="Hub revision of --model.")
    ] = None,
) -> None:
    """Measure batched DFlash: N slots decoded together, against plain batched decoding.

    Per slot count: plain decoding (batched, same N), single-slot DFlash run N times in a row, and batched DFlash; generation tok/s (prefill excluded), tau, round time split and E = t(plain step) / t(DFlash round). Greedy (T = 0); DFlash tokens are checked against plain.

    Examples:
      [bold]hf2q bench[/bold]   (the embedded demo pair, slots 1,2,4,8)
      [bold]hf2q bench -m ./qwen -d ./qwen-dflash --slots 1,4 --workload random --gen-tokens 64[/bold]
      [bold]hf2q bench --slots 8 --trials 5 --json --out bench.json[/bold]
      [bold]hf2q bench --slots 4 --requests-per-slot 4[/bold]   (16 requests queued on 4 slots)
    """
    from hf2q.cli import app as app_module
    from hf2q.runtime.bench import BenchConfig, parse_slots
    from hf2q.runtime.pair import DTYPE_CHOICES

    # Cheap checks first: nothing is loaded for a bad option.
    config = BenchConfig(
        slots=parse_slots(slots),
        gen_tokens=gen_tokens,
        prompt_tokens=prompt_tokens,
        trials=trials,
        warmup=warmup,
        block_size=block_size,
        workload=workload,
        baseline=baseline,
        seed=seed,
        idle=idle,
        requests_per_slot=requests_per_slot,
        lookup=lookup,
    ).validate()
    if dtype is not None and dtype not in DTYPE_CHOICES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    check_draft_head_bits(draft_head_bits)
    check_draft_vocab(draft_vocab)
    if out_file is not None:
        _check_out(out_file)

    from hf2q.cli.console import emit_json, err, is_terminal, warn
    from hf2q.platform import blas_hint, describe, ensure_fast_blas

    # May re-execute this process with OpenBLAS preloaded.
    plan = ensure_fast_blas(allow_reexec=app_module.STANDALONE)

    from hf2q.kernels import select
    from hf2q.runtime.bench import run_bench
    from hf2q.runtime.pair import load_pair

    pair = load_pair(
        model,
        draft,
        dflash=True,
        revision=revision,
        draft_head_bits=draft_head_bits,
        draft_vocab=draft_vocab,
    )
    if plan.action == "hint" and not json_out:
        warn(blas_hint(plan))
    use_chat = pair.chat_default if chat is None else chat
    from hf2q.runtime.pair import apply_dtype

    apply_dtype(pair.target, pair.drafter, dtype)
    for note in pair.target.draft_head_notes.values() if not json_out else ():
        warn(note)
    status = err.status("benchmarking") if is_terminal() and not json_out else None

    def progress(text: str) -> None:
        if status is not None:
            status.update(f"benchmarking: {text}")

    if status is not None:
        status.start()
    try:
        report = run_bench(
            pair.target,
            pair.drafter,
            config,
            tokenizer=pair.tokenizer,
            chat=use_chat,
            eos_token_ids=pair.eos_token_ids,
            progress=progress,
        )
    finally:
        if status is not None:
            status.stop()
    report = {
        "model": pair.target_source,
        "draft": pair.draft_source,
        "draft_head_bits": draft_head_bits or None,
        "draft_vocab": draft_vocab or None,
        **(
            {"draft_head_notes": list(pair.target.draft_head_notes.values())}
            if pair.target.draft_head_notes
            else {}
        ),
        **report,
        "platform": {**describe(), "kernels": select.summary(pair.target)},
    }
    if out_file is not None:
        _write_json(out_file, report)
    if json_out:
        emit_json(report)
    else:
        from hf2q.cli.bench_view import print_report

        print_report(report, terminal=is_terminal())


def _check_out(path: Path) -> None:
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():
        raise OutputError(f"cannot write --out {path}: folder {parent} does not exist; create it")
    if path.is_dir():
        raise OutputError(f"--out {path} is a folder: pass a file path such as {path}/bench.json")


def _write_json(path: Path, report: dict) -> None:
    import json
    import os

    path = path.expanduser()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write --out {path} ({exc.strerror}): check the path") from exc


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
