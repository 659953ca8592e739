"""The fused Gated-DeltaNet kernel's conv read: a thread per channel against a thread per
(step, channel), timed at the 4B shapes (MLX's CUDA backend only).

Why: a one-slot DFlash round's kernel trace on an H100 (session 47) had the fused kernel at 27 us
a layer for a 16-step verify, 0.66 ms of the round's 6.34, where the recurrence itself is a few
microseconds: with one thread block per (value head, 32 value rows) the 4B shapes launch 128
blocks, and the loads before session 48 walked 32 loops of dependent global loads a thread at 16
steps. The channel read (default) loads each channel's rows of the chunk once, all at a time.

For each batch size and block length, ``--layers`` launches over separate inputs (a layer each,
so the states come from memory, as in a forward) are one evaluation; the two reads take turns
within each rep after a warm-up each; medians and min-max of microseconds a launch, and whether
the two reads' outputs are bit-equal.

    python3 benchmarks/gdn_loads.py --batches 1,4,8 --steps 1,16 --out runs/gdn_loads.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

#: Qwen3.5-4B's Gated-DeltaNet: 16 key heads, 32 value heads, head dims 128, conv kernel 4.
HK, HV, DK, DV, KC = 16, 32, 128, 128, 4


def _layer_inputs(B: int, T: int, seed: int) -> tuple:
    mx.random.seed(seed)
    C = 2 * HK * DK + HV * DV
    bf = mx.bfloat16
    conv_state = (mx.random.normal((B, KC - 1, C)) * 0.5).astype(bf)
    qkv = (mx.random.normal((B, T, C)) * 0.5).astype(bf)
    conv_w = (mx.random.normal((C, KC)) * 0.3).astype(bf)
    a, b = (mx.random.normal((B, T, HV)).astype(bf) for _ in range(2))
    A_log = mx.random.uniform(0.0, 1.0, (HV,))
    dt_bias = mx.random.normal((HV,)).astype(bf)
    state = mx.random.normal((B, HV, DV, DK)) * 0.1
    args = (conv_state, qkv, conv_w, a, b, A_log, dt_bias, state)
    mx.eval(args)
    return args


def _launches(layers: list[tuple], step_loads: bool) -> list[mx.array]:
    from hf2q.kernels.cuda_gated_delta import gdn_fused_cuda

    dims = dict(num_k_heads=HK, key_dim=DK, num_v_heads=HV, value_dim=DV)
    outs = []
    for args in layers:
        # A verify's launch: outputs, the final state (rollback replays) and the conv window.
        outs.extend(
            gdn_fused_cuda(*args, **dims, record="final", window=True, step_loads=step_loads)
        )
    return outs


def _time(layers: list[tuple], step_loads: bool) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    outs = _launches(layers, step_loads)
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / len(layers) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,8", help="batch rows (slots), comma-separated")
    ap.add_argument("--steps", default="1,16", help="block lengths T, comma-separated")
    ap.add_argument("--layers", type=int, default=24, help="launches an evaluation (default 24)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        print("gdn_loads.py times CUDA kernels: run it where MLX's CUDA backend is available")
        return 2
    rows = []
    for B in (int(x) for x in a.batches.split(",")):
        for T in (int(x) for x in a.steps.split(",")):
            layers = [_layer_inputs(B, T, seed=i) for i in range(a.layers)]
            same = all(
                mx.array_equal(x, y).item()
                for x, y in zip(_launches(layers, False), _launches(layers, True), strict=True)
            )
            times: dict[str, list[float]] = {"channel": [], "step": []}
            for step_loads in (False, True):
                _time(layers, step_loads)  # compile / warm up
            for rep in range(a.reps):
                order = (False, True) if rep % 2 == 0 else (True, False)
                for step_loads in order:
                    times["step" if step_loads else "channel"].append(_time(layers, step_loads))
            row = {"batch": B, "T": T, "layers": a.layers, "bits_equal": same}
            for name, ts in times.items():
                row[f"{name}_us"] = round(statistics.median(ts), 2)
                row[f"{name}_us_min_max"] = [round(min(ts), 2), round(max(ts), 2)]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del layers
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"shape": [HK, HV, DK, DV, KC], "results": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
