"""All terminal output of the CLI: Rich on a terminal, plain lines otherwise, JSON on request.

Library code never prints; commands hand their results to these helpers.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None] | None]:
    """A byte progress bar on stderr while the block runs; yields ``update(done, total)``.

    Yields None when stderr is not a terminal (nothing is drawn then).
    """
    if not err.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    task = bar.add_task(description, total=None, visible=False)  # shown once there is a total

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total, visible=True)

    with bar:
        yield update


@contextlib.contextmanager
def hub_download_progress() -> Iterator[Any]:
    """A tqdm class for huggingface_hub downloads that draws with Rich on stderr.

    Yields the class to pass as ``tqdm_class`` (None when stderr is not a terminal, which turns
    download bars off). All bars of one download share one Rich display.
    """
    if not err.is_terminal:
        yield None
        return
    from huggingface_hub.utils import tqdm as hf_tqdm
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class _Amount(ProgressColumn):
        def render(self, task: Any) -> Text:
            done, total = task.completed, task.total
            if task.fields.get("unit") == "B":
                shown = f"{done / 2**20:.1f}/{(total or 0) / 2**20:.1f} MB"
            else:
                shown = f"{int(done)}/{int(total or 0)} files"
            return Text(shown)

    bars = Progress(
        TextColumn("{task.description}"), BarColumn(), _Amount(), console=err, transient=True
    )

    class RichTqdm(hf_tqdm):  # type: ignore[misc, valid-type]
        """tqdm's bookkeeping, Rich's drawing (tqdm's own output is off: gui mode)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["gui"] = True
            super().__init__(*args, **kwargs)
            if not self.disable:
                self._task = bars.add_task(
                    self.desc or "Downloading", total=self.total, unit=kwargs.get("unit", "it")
                )

        def display(self, *args: Any, **kwargs: Any) -> None:
            task = getattr(self, "_task", None)
            if task is not None:
                bars.update(task, completed=self.n, total=self.total, description=self.desc)

        def clear(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            if not self.disable:
                self.display()
            super().close()

    with bars:
        yield RichTqdm
