"""``hf2q info``: versions, the device MLX uses, and which BLAS the CPU backend loaded."""

from __future__ import annotations

from typing import Annotated

import typer


def info(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show versions, the MLX device and backend, and the BLAS in use.

    Example: [bold]hf2q info --json[/bold]
    """
    from hf2q.cli.console import emit_json, print_kv
    from hf2q.platform import describe

    facts = describe()
    if json_out:
        emit_json(facts)
    else:
        print_kv("hf2q environment", facts)


def register(app: typer.Typer) -> None:
    app.command("info")(info)
