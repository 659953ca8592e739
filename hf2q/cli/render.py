"""Terminal rendering of ``hf2q generate``: streamed text, live DFlash rounds, the final summary.

What it does: turn the runtime's events (``hf2q.runtime.dflash``) into output. On a terminal a
Rich live view shows the text as it streams plus the latest rounds (drafted, accepted, rolled
back, committed, running tau, tok/s, time split) and ends with a summary table. Not on a
terminal the text goes to stdout as plain text and the statistics to stderr as plain lines, so
``hf2q generate ... > out.txt`` keeps only the text. It also builds the ``--json`` object.

What it does not do: run models or decide anything about decoding.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from hf2q.cli.console import err, out

#: Rounds shown in the live table.
LIVE_ROWS = 8


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


class GenerateView:
    """Consumes events one by one; ``close()`` ends the live view. Use as a context manager."""

    def __init__(
        self, tokenizer: Any, *, stats: bool, live: bool, dflash: bool, echo: bool = True
    ) -> None:
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos = set(tokenizer.eos_token_ids or ())
        self.stats = stats
        self.dflash = dflash
        self.echo = echo  # write the text to stdout (off for --json)
        self.text = ""
        self.rows: deque[tuple[str, ...]] = deque(maxlen=LIVE_ROWS)
        self.sum_a = self.n_rounds = 0
        self.t_draft = self.t_verify = self.t_roll = 0.0
        self.tps = 0.0
        self.live: Live | None = None
        if live:
            # Transient: the live region (text tail + rounds) is replaced by the full text at close.
            self.live = Live(self._renderable(), console=out, auto_refresh=False, transient=True)
            self.live.start()
        self._last_refresh = 0.0

    # -- events ----------------------------------------------------------------------------------
    def tokens(self, ids: tuple[int, ...] | list[int]) -> None:
        for t in ids:
            if t in self.eos:
                continue
            self.detok.add_token(t)
        self._emit(self.detok.last_segment)

    def finish(self) -> None:
        self.detok.finalize()
        self._emit(self.detok.last_segment)
        if self.live is None and self.echo:
            out.file.write("\n")
            out.file.flush()

    def round(self, ev: Any) -> None:
        self.n_rounds += 1
        self.sum_a += ev.accepted
        self.t_draft += ev.t_draft
        self.t_verify += ev.t_verify
        self.t_roll += ev.t_rollback
        tau = (self.sum_a + self.n_rounds) / self.n_rounds
        self.tps = (ev.generated - 1) / ev.elapsed if ev.elapsed > 0 else 0.0
        row = (
            str(ev.index),
            f"{ev.drafted} lookup" if ev.source == "lookup" else str(ev.drafted),
            str(ev.accepted),
            str(ev.rolled_back),
            str(len(ev.committed)),
            f"{tau:.2f}",
            f"{self.tps:.1f}",
            f"{_ms(ev.t_draft)}/{_ms(ev.t_verify)}/{_ms(ev.t_rollback)}",
        )
        self.rows.append(row)
        self.tokens(ev.committed)
        if self.stats and self.live is None:
            err.print(
                f"round {row[0]}: drafted {row[1]} accepted {row[2]} rolled_back {row[3]} "
                f"committed {row[4]} tau {row[5]} tok/s {row[6]} draft/verify/rollback_ms {row[7]}",
                soft_wrap=True,
                highlight=False,
            )
        self._refresh()

    def step(self, ev: Any) -> None:
        self.tps = (ev.generated - 1) / ev.elapsed if ev.elapsed > 0 else 0.0
        self.tokens((ev.token,))
        self._refresh()

    # -- output ----------------------------------------------------------------------------------
    def _emit(self, segment: str) -> None:
        if not segment:
            return
        self.text += segment
        if self.live is None and self.echo:
            out.file.write(segment)
            out.file.flush()

    def _renderable(self) -> Any:
        # Only the tail of the text fits above the table; the whole text is printed at close.
        room = max(3, out.size.height - (LIVE_ROWS + 8 if self.stats else 2))
        lines = self.text.splitlines()[-room:] if self.text else []
        body = Text("\n".join(lines))
        if not self.stats:
            return body
        if not self.dflash:
            return Group(body, Text(f"\n{self.tps:.1f} tok/s", style="dim"))
        table = Table(
            title="DFlash rounds (latest)",
            title_justify="left",
            show_edge=False,
            header_style="bold",
        )
        for name in ("round", "drafted", "accepted", "rolled back", "committed", "tau", "tok/s"):
            table.add_column(name, justify="right")
        table.add_column("draft/verify/rollback ms", justify="right")
        for row in self.rows:
            table.add_row(*row)
        return Group(body, Text(""), table)

    def _refresh(self) -> None:
        # At most ~20 redraws a second: rendering every round would slow fast generation down.
        now = time.perf_counter()
        if self.live is not None and now - self._last_refresh > 0.05:
            self._last_refresh = now
            self.live.update(self._renderable(), refresh=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
            if self.echo:
                out.print(Text(self.text))

    def __enter__(self) -> GenerateView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summary_rows(summary: Any, extra: dict[str, Any]) -> dict[str, str]:
    """The final statistics as ``name -> value`` strings (tables and plain lines)."""
    rows: dict[str, str] = {
        "mode": summary.mode,
        "finish reason": summary.finish_reason,
        "prompt tokens": str(summary.prompt_tokens),
        "generated tokens": str(summary.generation_tokens),
        "prefill": f"{summary.prompt_tps:.1f} tok/s ({summary.prefill_time:.3f} s)",
        "generation": f"{summary.generation_tps:.1f} tok/s (prefill excluded)",
    }
    if summary.mode == "dflash":
        total = summary.t_draft + summary.t_verify + summary.t_rollback
        rows.update(
            {
                "rounds": str(summary.rounds)
                + (
                    f" ({summary.lookup_rounds} drafted by lookup)"
                    if summary.lookup_rounds is not None
                    else ""
                ),
                "block size": block_size_text(summary),
                "tau (mean a+1)": f"{summary.tau:.2f}" if summary.tau is not None else "-",
                "acceptance rate": _pct(summary.acceptance_rate),
                "draft share": _pct(summary.draft_share),
                "time draft/verify/rollback": (
                    f"{summary.t_draft:.3f} / {summary.t_verify:.3f} / {summary.t_rollback:.3f} s"
                    + (
                        f" ({summary.t_draft / total:.0%} / {summary.t_verify / total:.0%} / "
                        f"{summary.t_rollback / total:.0%})"
                        if total > 0
                        else ""
                    )
                ),
            }
        )
    rows["peak memory"] = f"{summary.peak_memory_gb:.3f} GB"
    rows.update({k: str(v) for k, v in extra.items()})
    return rows


def block_size_text(summary: Any) -> str:
    """``16``, or with sizes chosen round by round ``auto (rounds: 4 x 12, 16 x 3)``."""
    if not summary.block_sizes:
        return str(summary.block_size)
    return "auto (rounds: " + ", ".join(f"{b} x {n}" for b, n in summary.block_sizes.items()) + ")"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def histogram_table(hist: list[int]) -> Table:
    """Accepted drafts per round: count and a bar for a = 0..B-1."""
    table = Table(title="accepted drafts per round", title_justify="left", show_edge=False)
    table.add_column("a", justify="right")
    table.add_column("rounds", justify="right")
    table.add_column("")
    top = max(hist) if hist and max(hist) > 0 else 1
    for a, n in enumerate(hist):
        table.add_row(str(a), str(n), "#" * round(30 * n / top))
    return table


def print_summary(summary: Any, extra: dict[str, Any], *, terminal: bool) -> None:
    """The final statistics: Rich tables on a terminal, plain ``key: value`` lines on stderr."""
    rows = summary_rows(summary, extra)
    if not terminal:
        for key, value in rows.items():
            err.print(f"{key}: {value}", soft_wrap=True, highlight=False)
        if summary.accepted_histogram is not None:
            hist = " ".join(f"{a}:{n}" for a, n in enumerate(summary.accepted_histogram))
            err.print(f"accepted histogram: {hist}", soft_wrap=True, highlight=False)
        return
    table = Table(title="hf2q generate", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, value)
    out.print(table)
    if summary.accepted_histogram is not None:
        out.print(histogram_table(summary.accepted_histogram))


def json_record(summary: Any, text: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` object: the summary's fields that apply, the text and ``extra`` facts."""
    rec: dict[str, Any] = {
        "mode": summary.mode,
        "tokens": list(summary.tokens),
        "text": text,
        "finish_reason": summary.finish_reason,
        "prompt_tokens": summary.prompt_tokens,
        "generation_tokens": summary.generation_tokens,
        "prefill_time": summary.prefill_time,
        "decode_time": summary.decode_time,
        "prompt_tps": summary.prompt_tps,
        "generation_tps": summary.generation_tps,
        "peak_memory_gb": summary.peak_memory_gb,
    }
    if summary.mode == "dflash":
        rec.update(
            {
                "rounds": summary.rounds,
                "block_size": summary.block_size,
                "tau": summary.tau,
                "acceptance_rate": summary.acceptance_rate,
                "draft_share": summary.draft_share,
                "accepted_histogram": list(summary.accepted_histogram or []),
                "t_draft": summary.t_draft,
                "t_verify": summary.t_verify,
                "t_rollback": summary.t_rollback,
                "lookup_rounds": summary.lookup_rounds,
                "block_sizes": (
                    {str(b): n for b, n in summary.block_sizes.items()}
                    if summary.block_sizes
                    else None
                ),
            }
        )
    if summary.seed is not None:
        rec["seed"] = summary.seed
    rec.update(extra)
    return rec
