"""Where the fused Gated-DeltaNet kernel's device time goes, at the 4B shapes (MLX's CUDA
backend, torch's profiler for the kernels' device durations).

Why: session 47's one-slot DFlash round on an H100 had the fused kernel at 27 us a 16-step verify
layer (0.66 ms of the round's 6.34), 39 / 71 us at 4 / 8 slots, where the recurrence's arithmetic
is a few microseconds. Session 48 changed its conv read to a thread per channel (``channel``, the
default; ``step`` is the read before) and the one-slot layer went to 22.6 us in the round's trace.
This times the kernel's variants and probes side by side:

* ``channel``, ``step``: the two conv reads (same bits: checked here too);
* probes (timing only, their outputs are wrong): ``no-steps`` (the recurrence removed),
  ``no-conv`` (the conv rows' reads replaced by made-up values), ``no-norm`` (the q/k
  normalisation removed): what each phase costs is the time it takes off; and
  ``scalar-state``, the state read and written 4 bytes a load as before session 49 (same bits).
  Session 49's run had two candidates here: the float4 state read (now the kernel's) and four
  partial sums a lane for the recurrence's dot products (slower at 5 of 6 shapes, dropped).

For each batch size and block length, ``--layers`` launches over separate inputs (a layer each,
so states come from memory as in a forward) make one evaluation; every evaluation of the run is
traced in one trace of torch's profiler (CUPTI: the device's own start and end of each kernel).
Each variant's median device microseconds a launch (min-max over its launches); the variants
take turns within each rep.

    python3 benchmarks/gdn_loads.py --batches 1,4,8 --steps 1,16 --out runs/gdn_loads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gdn_record_cost import DK, DV, HK, HV, KC, layer_inputs  # noqa: E402

from hf2q.kernels import cuda_gated_delta as cg  # noqa: E402

#: Timing probes: replacements (text of the channel-read kernel's source, new text).
PROBES: dict[str, list[tuple[str, str]]] = {
    "no-steps": [
        (
            "for (int tt = 0; tt < tc; ++tt) {\n      const float gt",
            "for (int tt = 0; tt < 0; ++tt) {\n      const float gt",
        )
    ],
    "no-conv": [("xr[u] = hf2q_conv_in(t0 + u, ch);", "xr[u] = 0.25f * (float)(u + ch);")],
    "no-norm": [
        (
            "for (int row = warp; row < 2 * tc; row += WARPS) {",
            "for (int row = warp; row < 0; row += WARPS) {",
        )
    ],
    # the state read and written 4 bytes a load / store, as before session 49 (same bits)
    "scalar-state": [
        ("if ((reinterpret_cast<size_t>(state_in) & 15) == 0) {", "if (false) {"),
        (
            "      dst[j * 4 + sub] = make_float4(st[j * 4 + 0], st[j * 4 + 1], st[j * 4 + 2], "
            "st[j * 4 + 3]);",
            "      for (int c = 0; c < 4; ++c) {\n"
            "        state_out[srow + j * 16 + sub * 4 + c] = st[j * 4 + c];\n      }",
        ),
    ],
}


def _variant(step_loads: bool) -> dict[str, Any]:
    return dict(
        fused=True, record="final", write_y=True, replay=False, window=True, step_loads=step_loads
    )


def probe_spec(probe: str) -> dict[str, Any]:
    """``mx.fast.cuda_kernel``'s arguments for the channel read's kernel with ``probe`` applied
    (each replacement's text must be in the source once)."""
    spec = cg.kernel_spec(**_variant(False))
    for old, new in PROBES[probe]:
        if spec["source"].count(old) != 1:
            raise SystemExit(f"probe {probe}: {old!r} is not once in the kernel's source")
        spec["source"] = spec["source"].replace(old, new)
    spec["name"] = f"{spec['name']}_probe_{probe.replace('-', '_')}"
    return spec


@cache
def _probe_kernel(probe: str) -> Any:
    return mx.fast.cuda_kernel(**probe_spec(probe))


def _launches(layers: list[tuple], variant: str) -> list[mx.array]:
    dims = dict(num_k_heads=HK, key_dim=DK, num_v_heads=HV, value_dim=DV)
    outs: list[mx.array] = []
    if variant in PROBES:
        real = cg._kernel
        cg._kernel = lambda **v: _probe_kernel(variant)  # this process only: a timing probe
        try:
            for args in layers:
                outs.extend(cg.gdn_fused_cuda(*args, **dims, record="final", window=True))
        finally:
            cg._kernel = real
        return outs
    for args in layers:
        # A verify's launch: outputs, the final state (rollback replays) and the conv window.
        outs.extend(
            cg.gdn_fused_cuda(
                *args, **dims, record="final", window=True, step_loads=variant == "step"
            )
        )
    return outs


def _trace(plan: list[tuple[list[tuple], str]]) -> list[list[float]]:
    """Evaluate each (layers, variant) of ``plan`` in turn under one trace of torch's profiler
    (one per process: session 47 saw it crash on a third) and return each evaluation's device
    durations (us) of its launches, matched in order and by kernel name."""
    from gpu_timeline import chrome_trace, device_events
    from torch.profiler import ProfilerActivity, profile

    mx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for layers, variant in plan:
            mx.eval(_launches(layers, variant))
        mx.synchronize()
    events = [e for e in device_events(chrome_trace(prof), cats=("kernel",)) if "hf2q_gdn" in e[2]]
    return split_events(events, [(len(layers), variant) for layers, variant in plan])


def split_events(
    events: list[tuple[float, float, str]], plan: list[tuple[int, str]]
) -> list[list[float]]:
    """The durations of ``events`` (start, duration, kernel name; in start order) cut into the
    plan's evaluations ((launches, variant) each, in order), each launch checked to be its
    variant's kernel."""
    out, i = [], 0
    for n, variant in plan:
        chunk = events[i : i + n]
        i += n
        names = sorted({name for _, _, name in chunk})
        if len(chunk) != n or not all(_is_variant(name, variant) for name in names):
            raise SystemExit(
                f"the trace's kernels do not match the plan at evaluation {len(out)} "
                f"({variant}, {n} launches): {len(chunk)} kernels, {names}"
            )
        out.append([d for _, d, _ in chunk])
    if i != len(events):
        raise SystemExit(f"the trace has {len(events) - i} kernels more than the plan")
    return out


def _is_variant(name: str, variant: str) -> bool:
    """Whether kernel ``name`` is ``variant``'s (the channel read's name has no other's tag)."""
    if variant == "channel":
        return "steploads" not in name and "_probe_" not in name
    return _tag(variant) in name


def _tag(variant: str) -> str:
    """What the kernel name of a variant other than the channel read holds."""
    if variant == "step":
        return "steploads"
    return "_probe_" + variant.replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8", help="batch rows (slots), comma-separated")
    ap.add_argument("--steps", default="1,16", help="block lengths T, comma-separated")
    ap.add_argument("--variants", default="channel,step,no-steps,no-conv,no-norm,scalar-state")
    ap.add_argument("--layers", type=int, default=24, help="launches an evaluation (default 24)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        print("gdn_loads.py times CUDA kernels: run it where MLX's CUDA backend is available")
        return 2
    variants = a.variants.split(",")
    configs = [(int(B), int(T)) for B in a.batches.split(",") for T in a.steps.split(",")]
    inputs, same = {}, {}
    for B, T in configs:
        layers = inputs[B, T] = [tuple(x) for x in layer_inputs(B, a.layers, seed=T, steps=T)]
        same[B, T] = all(
            mx.array_equal(x, y).item()
            for x, y in zip(_launches(layers, "channel"), _launches(layers, "step"), strict=True)
        )
        for v in variants:
            mx.eval(_launches(layers, v))  # compile / warm up
    plan, keys = [], []
    for rep in range(a.reps):
        for B, T in configs:
            for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
                plan.append((inputs[B, T], v))
                keys.append((B, T, v))
    times: dict[tuple, list[float]] = {}
    for key, durs in zip(keys, _trace(plan), strict=True):
        times.setdefault(key, []).extend(durs)
    rows = []
    for B, T in configs:
        row: dict[str, Any] = {"batch": B, "T": T, "layers": a.layers, "bits_equal": same[B, T]}
        for v in variants:
            ts = times[B, T, v]
            row[f"{v}_us"] = round(statistics.median(ts), 2)
            row[f"{v}_us_min_max"] = [round(min(ts), 2), round(max(ts), 2)]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": [HK, HV, DK, DV, KC], "results": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
