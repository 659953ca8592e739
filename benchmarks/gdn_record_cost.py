"""What a verify's Gated-DeltaNet record and its rollback cost on CUDA, two ways, at the 4B shape.

Why: session 22's kernel traces (docs/BENCHMARKS.md) found the fused recurrence writing every
step's state for the rollback taking 0.67 ms of a 1-slot DFlash round, 1.41 ms at 4 slots and
2.85 ms at 8 (16 float32 states of 32 x 128 x 128 a row and layer). The runtime records them
(``record="states"``) and restores every layer in one copying launch
(``hf2q.kernels.cuda_rollback``). The other way: the verify keeps only its final state
(``record="final"``) and the rollback replays each row's kept steps from the state before the
block (``gdn_fused_cuda(..., steps=keep)``, one count per row; the same bits as the recorded
state, tests/test_kernels_gated_delta.py). This times both over the 24 Gated-DeltaNet layers of
Qwen3.5-4B (16 key / 32 value heads of 128, conv 4 over 8192 channels, T = 16, bf16), each
row keeping a random number of positions, the two ways taking turns rep by rep
(``node_cost._time_all``), each compiled (``mx.compile``, as the runtime's runners and rollback
launch are); ``*_ms`` is an evaluation until its results are ready, ``*_host_ms`` the host's
building and encoding of it.

* ``states``: per layer the verify kernel writing per-step states; then one rollback launch for
  all layers (conv rows and states copied).
* ``final+replay``: per layer the verify kernel writing its final state, then a replay of each
  row's kept steps, and the kept conv rows gathered.

Usage (GPU): ``python3 benchmarks/gdn_record_cost.py --rows 1,4,8 --reps 20 --out FILE``
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_cost import _cuda, _time_all  # noqa: E402

from hf2q.kernels import cuda_rollback  # noqa: E402
from hf2q.kernels.cuda_gated_delta import gdn_fused_cuda  # noqa: E402

HK, HV, DK, DV, KC, T = 16, 32, 128, 128, 4, 16
C = 2 * HK * DK + HV * DV
DIMS = dict(num_k_heads=HK, key_dim=DK, num_v_heads=HV, value_dim=DV)


def layer_inputs(B: int, layers: int, seed: int, steps: int = T) -> list[list[mx.array]]:
    """Per layer: conv_state, qkv, conv_w, a, b, A_log, dt_bias, state (random, model dtypes)
    of a ``steps``-token block at the 4B shapes (``gdn_loads.py`` uses them too)."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        out.append(
            [
                (mx.random.normal((B, KC - 1, C)) * 0.5).astype(mx.bfloat16),
                (mx.random.normal((B, steps, C)) * 0.5).astype(mx.bfloat16),
                (mx.random.normal((C, KC)) * 0.3).astype(mx.bfloat16),
                mx.random.normal((B, steps, HV)).astype(mx.bfloat16),
                mx.random.normal((B, steps, HV)).astype(mx.bfloat16),
                mx.random.uniform(-1.0, 1.0, (HV,)),
                mx.random.normal((HV,)).astype(mx.bfloat16),
                mx.random.normal((B, HV, DV, DK)) * 0.1,
            ]
        )
    mx.eval(out)
    return out


def _states_way(keep: mx.array, *flat: mx.array) -> list[mx.array]:
    outs, convs, states = [], [], []
    for i in range(0, len(flat), 8):
        args = flat[i : i + 8]
        y, st = gdn_fused_cuda(*args, **DIMS, record="states")
        outs.append(y)
        convs.append(mx.concatenate([args[0], args[1]], axis=1))
        states.append(st)
    conv_out, state_out = cuda_rollback.rollback_cuda(convs, states, keep)
    return outs + conv_out + state_out


def _replay_way(keep: mx.array, *flat: mx.array) -> list[mx.array]:
    outs = []
    pos = (keep[:, None] + mx.arange(KC - 1))[..., None]  # (B, K-1, 1): the kept conv rows
    for i in range(0, len(flat), 8):
        args = flat[i : i + 8]
        y, _final = gdn_fused_cuda(*args, **DIMS, record="final")
        kept = gdn_fused_cuda(*args, **DIMS, record="final", steps=keep)
        conv = mx.take_along_axis(mx.concatenate([args[0], args[1]], axis=1), pos, axis=1)
        outs += [y, kept, conv]
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not _cuda():
        raise SystemExit("gdn_record_cost.py times CUDA kernels: run it on the GPU machine")
    ways = {"states": mx.compile(_states_way), "final+replay": mx.compile(_replay_way)}
    results = []
    for B in [int(r) for r in args.rows.split(",")]:
        flat = [a for layer in layer_inputs(B, args.layers, seed=B) for a in layer]
        mx.random.seed(100 + B)
        keep = mx.random.randint(1, T + 1, (B,)).astype(mx.int32)
        kinds = {name: functools.partial(fn, keep, *flat) for name, fn in ways.items()}
        row = {"rows": B, "layers": args.layers, "keep": keep.tolist()}
        for name, timed in _time_all(kinds, args.reps, per_node=False).items():
            row[f"{name}_ms"] = round(timed["total_us"] / 1e3, 4)
            row[f"{name}_host_ms"] = round((timed["build_us"] + timed["encode_us"]) / 1e3, 4)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results}) + "\n")


if __name__ == "__main__":
    main()
