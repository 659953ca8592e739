"""All terminal output of the CLI: Rich on a terminal, plain lines otherwise, JSON on request.

Library code never prints; commands hand their results to these helpers.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

#: Human output goes to stdout; progress, live views and warnings to stderr.
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def is_terminal() -> bool:
    return out.is_terminal


def emit_json(obj: Any) -> None:
    """Print ``obj`` as one JSON object on its own (last) line of stdout."""
    sys.stdout.write(json.dumps(obj, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def print_kv(title: str, rows: dict[str, Any]) -> None:
    """A two-column table of facts (plain ``key: value`` lines when not on a terminal)."""
    if not out.is_terminal:
        for key, value in rows.items():
            out.print(f"{key}: {value}", soft_wrap=True)
        return
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, str(value))
    out.print(table)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {message}", soft_wrap=True)
