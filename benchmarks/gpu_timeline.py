"""When the GPU is busy during hf2q's decoding loops, and with what (a CUPTI kernel trace).

Why: a DFlash round's wall time is the host building and encoding its graphs plus the device
running them, partly overlapped; switching kernels off one at a time (``plain_ab.py``) cannot
tell whether a round is waiting on the host or on the device. This records every kernel the
device runs during a steady-state run (torch's profiler, which reads CUPTI's activity records for
the whole process: MLX's kernels, inside CUDA graphs too) and reports, per step: the wall time,
the time the device was busy (the union of the kernels' intervals), the kernels' summed time,
their count, and the kernels that take the most time, grouped by name.

Each (slot count, loop) is traced in its own process (the profiler crashed on an H200 when one
process started a third trace). Usage (a GPU machine with torch; the random 4B-shaped pair, 1,
2, 3, 4 slots)::

    python benchmarks/gpu_timeline.py --synthetic 4b --prompt-tokens 64 --loops slots-dflash,slots-plain \
        --slots 1,2,3,4 --tokens 32 --out timeline.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_profile import _once, loop_events  # noqa: E402
from slots_synthetic import add_pair_arguments, pair_and_prompts  # noqa: E402

from hf2q.runtime.dflash import RoundDone, StepDone  # noqa: E402
from hf2q.runtime.slots import SlotFinished, SlotRound  # noqa: E402

LOOPS = ("slots-dflash", "slots-plain", "dflash", "plain")

#: Trace event categories that are device work.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Trace event categories that are the host's CUDA API calls.
HOST_CATS = ("cuda_runtime", "cuda_driver")


def kernel_group(name: str) -> str:
    """A kernel's name without template arguments, launch suffixes and numbers, so launches of
    one kernel at different shapes fall in one group (``hf2q_small_mm_4_8_1`` -> ``hf2q_small_mm``)."""
    base = name.split("<", 1)[0].split("(", 1)[0].strip()
    base = re.sub(r"^void ", "", base)
    base = re.sub(r"(_\d+)+$", "", base)
    return base or name


def device_events(trace: dict, cats=DEVICE_CATS) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every event of a Chrome trace in ``cats``, by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in cats:
            out.append((float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "?"))))
    out.sort()
    return out


def summarize(events: list[tuple[float, float, str]], steps: int, wall_s: float, top: int) -> dict:
    """Per-step figures of one traced run: busy (union of intervals), summed kernel time, launch
    count, the idle gaps' distribution and the ``top`` kernel groups by time (ms per step)."""
    busy = total = 0.0
    end = None
    last = ""
    gaps: list[float] = []
    groups: dict[str, list] = {}
    where: dict[tuple[str, str], list[float]] = {}  # big gaps by (kernel before, kernel after)
    for ts, dur, name in events:
        total += dur
        grp = kernel_group(name)
        g = groups.setdefault(grp, [0.0, 0, []])
        g[0] += dur
        g[1] += 1
        g[2].append(dur)
        if end is None or ts >= end:
            if end is not None:
                gaps.append(ts - end)
                if ts - end >= 50.0:
                    w = where.setdefault((last, grp), [0.0, 0])
                    w[0] += ts - end
                    w[1] += 1
            busy += dur
            end = ts + dur
            last = grp
        elif ts + dur > end:
            busy += ts + dur - end
            end = ts + dur
            last = grp
    span = (events[-1][0] + events[-1][1] - events[0][0]) if events else 0.0
    gaps.sort()
    big = [g for g in gaps if g >= 50.0]
    per = max(steps, 1)
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_s * 1e3 / per, 4),
        "span_ms_per_step": round(span / 1e3 / per, 4),
        "busy_ms_per_step": round(busy / 1e3 / per, 4),
        "kernel_ms_per_step": round(total / 1e3 / per, 4),
        "kernels_per_step": round(len(events) / per, 1),
        "busy_share_of_span": round(busy / span, 4) if span else None,
        "gaps_over_50us_per_step": round(len(big) / per, 2),
        "gap_ms_over_50us_per_step": round(sum(big) / 1e3 / per, 4),
        "gap_median_us": round(gaps[len(gaps) // 2], 2) if gaps else None,
        "top": [
            {
                "group": k,
                "ms_per_step": round(v[0] / 1e3 / per, 4),
                "calls_per_step": round(v[1] / per, 2),
                "us_min_median_max": _spread(v[2]),
            }
            for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "big_gaps": [
            {
                "before": b,
                "after": a,
                "ms_per_step": round(v[0] / 1e3 / per, 4),
                "count_per_step": round(v[1] / per, 2),
            }
            for (b, a), v in sorted(where.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def host_events(trace: dict) -> list[tuple[float, float, str]]:
    """The host's CUDA API calls (start us, duration us, name), the thread that made the most
    of them (the decoding loop's) plain and any other's name suffixed with ``@thread N``."""
    raw = [
        (float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "?")), e.get("tid"))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS
    ]
    order = [tid for tid, _ in collections.Counter(e[3] for e in raw).most_common()]
    out = [
        (ts, d, n if tid == order[0] else f"{n}@thread {order.index(tid)}") for ts, d, n, tid in raw
    ]
    out.sort()
    return out


def idle_gaps(events: list[tuple[float, float, str]], least: float = 50.0) -> list[tuple]:
    """The device's idle intervals (start us, end us) of at least ``least`` us between its
    first and last event."""
    out, end = [], None
    for ts, dur, _ in events:
        if end is not None and ts - end >= least:
            out.append((end, ts))
        end = ts + dur if end is None else max(end, ts + dur)
    return out


def host_summary(
    host: list[tuple[float, float, str]], gaps: list[tuple], steps: int, top: int
) -> dict:
    """The host's CUDA API calls by name (ms, calls a step; the longest), and which of them
    overlap the device's idle gaps (ms of overlap a step): does the host wait in a graph's
    update or instantiation, in a launch, or in a synchronization while the device idles?"""
    per = max(steps, 1)
    calls: dict[str, list] = {}
    during: dict[str, float] = {}
    for ts, dur, name in host:
        c = calls.setdefault(name, [0.0, 0, 0.0])
        c[0] += dur
        c[1] += 1
        c[2] = max(c[2], dur)
        for a, b in gaps:  # few gaps a step: a plain scan is enough
            o = min(b, ts + dur) - max(a, ts)
            if o > 0:
                during[name] = during.get(name, 0.0) + o
    return {
        "api_ms_per_step": round(sum(c[0] for c in calls.values()) / 1e3 / per, 4),
        "api": [
            {
                "name": k,
                "ms_per_step": round(v[0] / 1e3 / per, 4),
                "calls_per_step": round(v[1] / per, 2),
                "max_us": round(v[2], 1),
            }
            for k, v in sorted(calls.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "api_during_gaps": [
            {"name": k, "ms_per_step": round(v / 1e3 / per, 4)}
            for k, v in sorted(during.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def _spread(durs: list[float]) -> list[float]:
    d = sorted(durs)
    return [round(d[0], 2), round(d[len(d) // 2], 2), round(d[-1], 2)]


def sequence(
    events: list[tuple[float, float, str]], limit: int, host: list | None = None
) -> list[list]:
    """The first ``limit`` device events as [start us from the first, duration us, group], with
    the host's CUDA API calls of at least 20 us among them (their group prefixed ``host:``)."""
    if not events:
        return []
    t0 = events[0][0]
    rows = [(ts, dur, kernel_group(n)) for ts, dur, n in events[:limit]]
    stop = events[min(limit, len(events)) - 1][0]
    rows += [(ts, dur, "host:" + n) for ts, dur, n in host or () if dur >= 20 and t0 <= ts <= stop]
    rows.sort()
    return [[round(ts - t0, 1), round(dur, 1), g] for ts, dur, g in rows]


def traced(
    loop: str, pair, prompts, slots: int, tokens: int, lookup: bool, cpu: bool = False
) -> tuple[dict, int, float]:
    """Run ``loop`` once, tracing the device (torch's profiler, device activity only) from its
    second round (or step) event to its first finished slot (one sequence: its last step): the
    steady state, without the prefills and the first round. Return (Chrome trace, rounds traced,
    wall seconds)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU if cpu else ProfilerActivity.CUDA])
    rounds, tic, on = 0, 0.0, False
    events = loop_events(loop, pair, prompts, slots, tokens, lookup)
    for ev in events:
        if isinstance(ev, (SlotRound, RoundDone, StepDone)):
            if on:
                rounds += 1
            elif ev.index >= 2:
                prof.start()
                on, tic = True, time.perf_counter()
            if on and getattr(ev, "finish_reason", None) is not None:
                break  # a single sequence's last step ends the trace
        elif isinstance(ev, SlotFinished) and on:
            break  # (the rest of the run is not traced)
    wall = time.perf_counter() - tic
    if on:
        if not cpu:
            torch.cuda.synchronize()
        prof.stop()
    events.close()
    if rounds == 0:
        raise SystemExit(f"{loop}: fewer than three rounds: raise --tokens")
    return chrome_trace(prof), rounds, wall


def chrome_trace(prof) -> dict:
    """A stopped torch profiler's Chrome trace, as a dict (through a temporary file)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text())
    finally:
        os.unlink(path)


def _each_in_its_own_process(args, counts: list[int], loops: list[str]) -> None:
    """Run this script once per (slot count, loop), each tracing once (torch's profiler crashed
    with a segmentation fault when one process started its third trace on the H200), and write
    their rows as one report."""
    import subprocess

    base = [sys.executable, str(Path(__file__).resolve())]
    for flag, value in (
        ("--model", args.model),
        ("--draft", args.draft),
        ("--synthetic", args.synthetic),
    ):
        if value:
            base += [flag, value]
    base += ["--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens)]
    base += ["--tokens", str(args.tokens), "--top", str(args.top), "--sequence", str(args.sequence)]
    base += ["--lookup"] * args.lookup + ["--cpu-check"] * args.cpu_check
    out: dict = {"pair": args.synthetic or args.model or "demo", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            for loop in loops:
                part = Path(tmp) / f"{loop}-{n}.json"
                cmd = [*base, "--slots", str(n), "--loops", loop, "--out", str(part)]
                res = subprocess.run(cmd)
                if res.returncode != 0 or not part.exists():
                    print(f"== {loop} slots {n}: failed (exit {res.returncode})", flush=True)
                    continue
                out["rows"] += json.loads(part.read_text())["rows"]
    if args.out:
        Path(args.out).write_text(json.dumps(out) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(ap)
    ap.add_argument("--loops", default="slots-dflash,slots-plain")
    ap.add_argument("--slots", default="1,4", help="comma list of slot counts (slots-* loops)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--lookup", action="store_true")
    ap.add_argument(
        "--sequence",
        type=int,
        default=0,
        help="also keep the first N traced device events in order (start, duration, kernel)",
    )
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    ap.add_argument(
        "--cpu-check",
        action="store_true",
        help="trace torch's host operators instead (none run: a check of this script without a GPU)",
    )
    args = ap.parse_args()
    counts = [int(v) for v in args.slots.split(",")]
    loops = args.loops.split(",")
    for loop in loops:
        if loop not in LOOPS:
            raise SystemExit(f"unknown loop {loop!r}: choose from {', '.join(LOOPS)}")
    if len(counts) * len(loops) > 1:  # one trace a process: a third one crashed the profiler
        _each_in_its_own_process(args, counts, loops)
        return

    import torch

    if not args.cpu_check:
        if not torch.cuda.is_available():
            raise SystemExit(
                "gpu_timeline.py needs a CUDA GPU and torch with CUDA: run it on the GPU machine"
                " (or pass --cpu-check)"
            )
        torch.cuda.init()
    (n,), (loop,) = counts, loops  # one trace in this process
    pair, _, prompts = pair_and_prompts(args, n)
    _once(loop, pair, prompts[:n], n, args.tokens, args.lookup)  # warm-up
    trace, steps, wall = traced(
        loop, pair, prompts[:n], n, args.tokens, args.lookup, args.cpu_check
    )
    events = device_events(trace, ("cpu_op",) if args.cpu_check else DEVICE_CATS)
    row = {"loop": loop, "slots": n, **summarize(events, steps, wall, args.top)}
    host = host_events(trace)
    row["host"] = host_summary(host, idle_gaps(events), steps, args.top)
    if args.sequence:
        row["sequence"] = sequence(events, args.sequence, host)
    out: dict = {"pair": args.synthetic or args.model or "demo", "rows": [row]}
    print(
        f"== {loop} slots {n}: {steps} steps; ms a step: wall {row['wall_ms_per_step']},"
        f" device busy {row['busy_ms_per_step']} (span {row['span_ms_per_step']}),"
        f" {row['kernels_per_step']} kernels, idle gaps >= 50 us"
        f" {row['gaps_over_50us_per_step']} ({row['gap_ms_over_50us_per_step']} ms)"
    )
    for t in row["top"]:
        print(
            f"   {t['ms_per_step']:8.4f} ms {t['calls_per_step']:7.2f}x"
            f" {t['us_min_median_max']} us  {t['group'][:100]}"
        )
    print("   idle gaps >= 50 us, by the kernels around them:")
    for g in row["big_gaps"][:8]:
        print(
            f"   {g['ms_per_step']:8.4f} ms {g['count_per_step']:6.2f}x"
            f"  {g['before'][:60]} -> {g['after'][:60]}"
        )
    hs = row["host"]
    print(f"   host CUDA API calls: {hs['api_ms_per_step']} ms a step")
    for a in hs["api"][:12]:
        print(
            f"   {a['ms_per_step']:8.4f} ms {a['calls_per_step']:7.2f}x max {a['max_us']} us  {a['name']}"
        )
    print("   host CUDA API calls during the idle gaps:")
    for a in hs["api_during_gaps"][:8]:
        print(f"   {a['ms_per_step']:8.4f} ms  {a['name']}")
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
