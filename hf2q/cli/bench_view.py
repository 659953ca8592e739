"""Terminal rendering of ``hf2q bench``: a Rich table of the report and a tok/s chart by slot count.

What it does: turn the report of ``hf2q.runtime.bench.run_bench`` into a table (one row per slot
count and mode) and a compact bar chart of generation tok/s, and say when batched DFlash ran with
many of its rows idle (:func:`drain_note`). On a terminal both are Rich
renderables; otherwise the same content is printed as plain text lines.

What it does not do: measure anything.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from hf2q.cli.console import out

#: Width of the longest bar of the chart, in characters.
BAR_WIDTH = 40
_MODE_STYLE = {"plain": "cyan", "dflash-seq": "yellow", "dflash": "green"}
_BLOCKS = " ▏▎▍▌▋▊▉█"


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    """A bar of eighth-blocks, ``width`` characters for ``top``."""
    if top <= 0 or value <= 0:
        return ""
    eighths = round(value / top * width * 8)
    full, rest = divmod(eighths, 8)
    return "█" * full + (_BLOCKS[rest] if rest else "")


def _rows(report: dict[str, Any]) -> list[list[str]]:
    lines = []
    for r in report["results"]:
        split = (
            f"{_f(r['draft_ms'], 2)}/{_f(r['verify_ms'], 2)}/{_f(r['rollback_ms'], 2)}"
            if r["mode"] != "plain"
            else "-"
        )
        per_slot = ",".join(_f(x, 0) for x in r["per_slot_tokens_per_s"])
        match = r.get("matches_plain")
        lines.append(
            [
                str(r["slots"]),
                r["mode"],
                _f(r["tokens_per_s"]),
                f"{_f(r['tokens_per_s_min'])}-{_f(r['tokens_per_s_max'])}",
                per_slot,
                _f(r["prefill_tokens_per_s"], 0),
                _f(r["tau"], 2),
                "-" if r.get("lookup_share") is None else f"{r['lookup_share'] * 100:.0f}%",
                _f(r["round_ms"], 2),
                _f(r.get("busy_rows"), 1),
                split,
                _f(r["E"], 3),
                _f(r["speedup_vs_plain"], 2),
                _f(r["scaling_vs_1_slot"], 2),
                "-" if match is None else f"{match * 100:.0f}%",
                _f(r["peak_memory_gb"], 3),
            ]
        )
    return lines


HEADERS = [
    "slots",
    "mode",
    "tok/s",
    "min-max",
    "per slot tok/s",
    "prefill tok/s",
    "tau",
    "lookup",
    "round ms",
    "busy rows",
    "draft/verify/rollback ms",
    "E",
    "x plain",
    "x 1 slot",
    "= plain",
    "peak GB",
]


def chart_lines(report: dict[str, Any]) -> list[tuple[str, str, str, float]]:
    """(slots label, mode, bar, tok/s) per result row, bars scaled to the fastest row."""
    results = report["results"]
    top = max((r["tokens_per_s"] or 0.0) for r in results) if results else 0.0
    lines = []
    prev = None
    for r in results:
        label = str(r["slots"]) if r["slots"] != prev else ""
        prev = r["slots"]
        lines.append((label, r["mode"], _bar(r["tokens_per_s"] or 0.0, top), r["tokens_per_s"]))
    return lines


def drain_note(report: dict[str, Any]) -> str | None:
    """A line for when batched DFlash rounds ran with many rows idle (below 3/4 of the slots on
    average): its requests finish at different rounds, the batch runs on for the slowest, so its
    tok/s at N slots is partly a smaller batch's; with one request per slot it names the option
    that keeps the rows busy. None when no row says so."""
    drained = [
        r
        for r in report["results"]
        if r["mode"] == "dflash"
        and r["slots"] > 1
        and r.get("busy_rows") is not None
        and r["busy_rows"] < 0.75 * r["slots"]
    ]
    if not drained:
        return None
    r = max(drained, key=lambda r: r["slots"])
    line = (
        f"note: at {r['slots']} slots batched DFlash kept {r['busy_rows']:.1f} rows busy on "
        "average: its requests finish at different rounds and the batch runs on for the slowest"
    )
    if report["config"].get("requests_per_slot", 1) == 1:
        line += (
            "; --requests-per-slot K queues K requests per slot, so a finished row takes the"
            " next one (continuous batching)"
        )
    return line


#: Host speed changes beyond this ratio during a run get a note (:func:`host_note`).
HOST_DRIFT = 1.3


def host_line(host: dict[str, Any]) -> str:
    """A report's ``host`` record in words (the view's last line, ``benchmarks/bench_rows.py``)."""
    return (
        f"host: {host['python_loop_adds']:,} Python additions in "
        f"{host['python_loop_ms_before']:.0f} ms before the runs, "
        f"{host['python_loop_ms_after']:.0f} ms after (host-bound rounds follow it)"
    )


def host_note(report: dict[str, Any]) -> str | None:
    """A line for when the host ran Python at clearly different speeds before and after the
    runs (more than :data:`HOST_DRIFT` apart): host-bound rounds moved with it, so the rows were
    measured on a changing machine. None otherwise, or without a ``host`` record."""
    host = report.get("host")
    if not host:
        return None
    before, after = host["python_loop_ms_before"], host["python_loop_ms_after"]
    low, high = sorted((before, after))
    if low <= 0 or high / low <= HOST_DRIFT:
        return None
    ratio = high / low
    way = "slower" if after > before else "faster"
    return (
        f"note: this host ran Python {ratio:.1f}x {way} after the runs than before ({before:.0f}"
        f" against {after:.0f} ms for {host['python_loop_adds']:,} additions): host-bound rounds"
        " changed with it; compare rows from a quiet machine"
    )


def print_report(report: dict[str, Any], *, terminal: bool) -> None:
    """The table, then the chart, then one line on what was measured."""
    cfg = report["config"]
    about = (
        f"{report.get('model')} + {report.get('draft')}"
        + (
            f" (draft head {report['draft_head_bits']}-bit)"
            if report.get("draft_head_bits")
            else ""
        )
        + (
            f" (draft vocabulary {report['draft_vocab']} tokens)"
            if report.get("draft_vocab")
            else ""
        )
        + f"; workload {cfg['workload']}, "
        f"{cfg['gen_tokens']} tokens per request, "
        f"{cfg.get('requests_per_slot', 1)} request(s) per slot, block size {cfg['block_size']}, "
        f"median of {cfg['trials']} trial(s) after {cfg['warmup']} warm-up; "
        f"{report.get('platform', {}).get('backend', '?')}, BLAS {report.get('platform', {}).get('blas_kind', '?')}"
    )
    if report.get("host"):
        about += "; " + host_line(report["host"])
    rows = _rows(report)
    notes = [n for n in (drain_note(report), host_note(report)) if n]
    if not terminal:
        # Plain aligned columns (no cell contains a space, so the lines split on whitespace).
        cells = [[h.replace(" ", "_") for h in HEADERS], *rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS))]
        for row in cells:
            out.print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), soft_wrap=True)
        out.print("generation tok/s by slot count (prefill excluded)", soft_wrap=True)
        for label, mode, bar, tps in chart_lines(report):
            out.print(f"{label:>3} {mode:<10} {bar} {_f(tps)}", soft_wrap=True)
        out.print(about, soft_wrap=True)
        for note in notes:
            out.print(note, soft_wrap=True)
        return
    table = Table(title="hf2q bench", title_justify="left")
    for i, h in enumerate(HEADERS):
        table.add_column(h, justify="left" if i in (1, 4) else "right", no_wrap=i != 4)
    prev = None
    for r, row in zip(report["results"], rows):
        if prev is not None and r["slots"] != prev:
            table.add_section()
        prev = r["slots"]
        table.add_row(*row, style=_MODE_STYLE.get(r["mode"]))
    out.print(table)
    chart = Text("generation tok/s by slot count (prefill excluded)\n", style="bold")
    for label, mode, bar, tps in chart_lines(report):
        chart.append(f"{label:>3} {mode:<10} ")
        chart.append(bar, style=_MODE_STYLE.get(mode, ""))
        chart.append(f" {_f(tps)}\n")
    out.print(chart)
    out.print(Text(about, style="dim"), soft_wrap=True)
    for note in notes:
        out.print(Text(note, style="yellow"), soft_wrap=True)
