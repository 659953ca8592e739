"""``hf2q generate``: DFlash speculative decoding (or plain decoding) of one prompt, with live stats.

Thin: validates options, arranges the fast CPU BLAS, loads the pair (``hf2q.runtime.pair``),
runs ``hf2q.runtime.dflash`` and hands its events to ``hf2q.cli.render``.
"""

from __future__ import annotations

import sys
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
    parse_block_size,
)
from hf2q.errors import UsageError


def generate(
    prompt: Annotated[
        str | None,
        typer.Argument(help="The prompt. Omit it to use --prompt-file or standard input."),
    ] = None,
    model: ModelOption = None,
    draft: DraftOption = None,
    dflash: Annotated[
        bool,
        typer.Option(
            "--dflash/--no-dflash", help="Speculative decoding, or plain one-token steps."
        ),
    ] = True,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from this file.")
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")
    ] = 256,
    temp: Annotated[float, typer.Option("--temp", help="Temperature; 0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, (0, 1].")] = 1.0,
    top_k: Annotated[
        int, typer.Option("--top-k", help="Keep the k likeliest tokens; 0 = off.")
    ] = 0,
    seed: Annotated[int | None, typer.Option("--seed", help="Random seed (T > 0).")] = None,
    block_size: Annotated[
        str | None,
        typer.Option(
            "--block-size",
            "-b",
            help="DFlash block size B: 2..the drafter's, or auto (each round's size from what "
            "the rounds so far cost and accepted; greedy, synchronous rounds). Default: auto on "
            "a CPU (its verify costs about linearly in the tokens), else the drafter's.",
        ),
    ] = None,
    lookup: Annotated[
        bool,
        typer.Option(
            "--lookup/--no-lookup",
            help="DFlash rounds may draft the continuation of the text's own last n-gram when "
            "that accepts more than the drafter (same output; same distribution at T > 0).",
        ),
    ] = True,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--no-chat",
            help="Apply the chat template (default: yes when the model has one).",
        ),
    ] = None,
    thinking: Annotated[
        bool | None,
        typer.Option(
            "--thinking/--no-thinking",
            help="enable_thinking for the chat template (default: the template's).",
        ),
    ] = None,
    stats: Annotated[
        bool, typer.Option("--stats/--no-stats", help="Show rounds and the summary.")
    ] = True,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (last line) instead of text.")
    ] = False,
    dtype: DtypeOption = None,
    draft_head_bits: DraftHeadBitsOption = 0,
    draft_vocab: DraftVocabOption = 0,
    revision: Annotated[
        str | None, typer.Option("--revision", help="Hub revision of --model.")
    ] = None,
) -> None:
    """Generate text with lossless DFlash speculative decoding (or plain decoding).

    [bold]hf2q generate[/bold]  runs the embedded demo pair.

    [bold]hf2q generate "Write a haiku" -m Qwen/Qwen3.5-4B[/bold]  takes the drafter from the registry.

    [bold]hf2q generate -m ./qwen -d ./qwen-dflash --temp 0.7 --seed 1 --json < prompt.txt[/bold]
    """
    from hf2q.cli import app as app_module
    from hf2q.cli.console import emit_json, is_terminal, warn

    # Cheap checks first: nothing is loaded for a bad option.
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {max_tokens}")
    block_size = parse_block_size(block_size)
    if block_size is not None and not dflash:
        raise UsageError("--block-size applies to DFlash only: drop it or drop --no-dflash")
    check_draft_head_bits(draft_head_bits)
    check_draft_vocab(draft_vocab)
    if prompt is not None and prompt_file is not None:
        raise UsageError("pass the prompt as an argument or with --prompt-file, not both")

    from hf2q.platform import blas_hint, blas_summary, ensure_fast_blas
    from hf2q.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, seed=seed).validate()
    # May re-execute this process with OpenBLAS preloaded (before stdin is read).
    plan = ensure_fast_blas(allow_reexec=app_module.STANDALONE)
    text = _read_prompt(prompt, prompt_file)

    from hf2q.kernels import select
    from hf2q.runtime.block_size import AUTO
    from hf2q.runtime.dflash import (
        PrefillDone,
        RoundDone,
        StepDone,
        Summary,
        auto_block_applies,
        dflash_generate,
        plain_generate,
    )
    from hf2q.runtime.pair import (
        DTYPE_CHOICES,
        apply_dtype,
        dflash_cpu_note,
        encode_prompt,
        load_pair,
    )

    if dtype is not None and dtype not in DTYPE_CHOICES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    pair = load_pair(
        model,
        draft,
        dflash=dflash,
        revision=revision,
        draft_head_bits=draft_head_bits,
        draft_vocab=draft_vocab,
    )
    compute_dtype = apply_dtype(pair.target, pair.drafter if dflash else None, dtype)
    if text is None:
        if pair.default_prompt is None:
            raise UsageError(
                "no prompt: pass it as an argument, with --prompt-file, or on standard input"
            )
        text = pair.default_prompt
    if isinstance(block_size, int) and block_size > pair.drafter.block_size:
        raise UsageError(
            f"--block-size {block_size} is above the drafter's block size {pair.drafter.block_size}: "
            f"pass at most {pair.drafter.block_size}"
        )
    use_chat = pair.chat_default if chat is None else chat
    ids = encode_prompt(pair.tokenizer, text, chat=use_chat, thinking=thinking)
    eos = pair.eos_token_ids
    if plan.action == "hint" and not json_out:
        warn(blas_hint(plan))
    if dflash and not json_out and (note := dflash_cpu_note(pair.target)):
        warn(note)
    for note in pair.target.draft_head_notes.values() if dflash and not json_out else ():
        warn(note)
    if dflash and block_size is None and select.backend() == "cpu" and sampling.greedy:
        block_size = AUTO  # a CPU's verify costs about linearly in its rows: shorter blocks win
    if (
        block_size == AUTO
        and not json_out
        and not auto_block_applies(sampling, select.lagged_for(lookup))
    ):
        warn(
            f"--block-size auto applies to greedy decoding with synchronous rounds: these rounds "
            f"keep the drafter's size {pair.drafter.block_size}"
        )
    if dflash:
        events = dflash_generate(
            pair.target,
            pair.drafter,
            ids,
            max_tokens=max_tokens,
            sampling=sampling,
            block_size=block_size,
            eos_token_ids=eos,
            lookup=lookup,
        )
    else:
        events = plain_generate(
            pair.target, ids, max_tokens=max_tokens, sampling=sampling, eos_token_ids=eos
        )

    from hf2q.cli.render import GenerateView, json_record, print_summary

    terminal = is_terminal() and not json_out
    summary = None
    extra = {
        "model": pair.target_source,
        **({"draft": pair.draft_source} if dflash else {}),
        **({"draft_head_bits": draft_head_bits} if dflash and draft_head_bits else {}),
        **({"draft_vocab": draft_vocab} if dflash and draft_vocab else {}),
        **(
            {"draft_head_notes": list(pair.target.draft_head_notes.values())}
            if dflash and pair.target.draft_head_notes
            else {}
        ),
        "dtype": compute_dtype,
        "kernels": select.summary(pair.target),
        **blas_summary(),
    }
    view = GenerateView(
        pair.tokenizer,
        stats=stats and not json_out,
        live=terminal,
        dflash=dflash,
        echo=not json_out,
    )
    with view:
        for ev in events:
            if isinstance(ev, PrefillDone):
                view.tokens((ev.token,))
            elif isinstance(ev, RoundDone):
                view.round(ev)
            elif isinstance(ev, StepDone):
                view.step(ev)
            elif isinstance(ev, Summary):
                summary = ev
        view.finish()
    assert summary is not None
    if json_out:
        emit_json(json_record(summary, view.text, extra))
    elif stats:
        print_summary(summary, extra, terminal=terminal)


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    """The prompt text from the argument, the file or stdin; None when none was given."""
    if prompt_file is not None:
        try:
            text = prompt_file.read_text()
        except OSError as exc:
            raise UsageError(
                f"cannot read --prompt-file {prompt_file} ({exc.strerror}): check the path"
            ) from exc
    elif prompt is not None:
        text = prompt
    elif sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read()
        if not text:
            return None  # nothing piped in (e.g. /dev/null): the demo pair has its own prompt
    else:
        return None
    if not text.strip():
        raise UsageError("the prompt is empty: pass some text (argument, --prompt-file or stdin)")
    return text


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
