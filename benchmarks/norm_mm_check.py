"""Where ``HF2Q_NORM_MM=1`` changes a synthetic 4B-shaped target's tokens (a GPU diagnosis).

Session 60 (H100): with the switch, plain decoding's tokens differed from the default's while
the CUDA unit tests of the normed launches (random rows, 1/16/64 rows of 2560) and the demo
target's logits were equal. This script, on the random 4B-shaped pair:

1. tokens of plain decoding (one slot) with the switch off and on, and of DFlash with it on;
2. with compilation off, every normed launch checked against MLX's norm then the same launch
   without it; the first mismatching inputs are saved to ``--out`` (``x``, the norm's weight,
   MLX's normed rows and the launch's, as float32 .npy) for the CPU emulator.

    python3 benchmarks/norm_mm_check.py --out DIR [--no-eager]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--no-eager", dest="eager", action="store_false", help="the tokens only (step 1)"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import mlx.core as mx
    import numpy as np
    from host_profile import _once
    from plain_ab import _random_prompt
    from slots_synthetic import synthetic_pair

    from hf2q.kernels import cuda_matmul as cm
    from hf2q.kernels import select

    os.environ["HF2Q_DRAFT_VOCAB"] = "32768"
    pair = synthetic_pair("4b")
    prompt = _random_prompt(pair, 64, 1)
    report: dict = {}

    def toks(loop: str) -> list[int]:
        s = _once(loop, pair, [prompt], 1, args.tokens, False)
        return [t for q in s.requests for t in q.tokens]

    for flag in ("0", "1"):
        os.environ[select.NORM_MM_ENV] = flag
        report[f"enabled {flag}"] = select.norm_mm_enabled()
        report[f"plain {flag}"] = toks("slots-plain")
    report["dflash 1"] = toks("slots-dflash")
    report["plain equal"] = report["plain 0"] == report["plain 1"]
    report["dflash equals plain"] = report["dflash 1"] == report["plain 1"]
    print({k: v[:12] if isinstance(v, list) else v for k, v in report.items()}, flush=True)
    if not args.eager:
        (args.out / "norm_mm_check.json").write_text(json.dumps(report, indent=1))
        return 0

    found: list[dict] = []
    real = {
        "single": cm.small_matmul_cuda,
        "grouped": cm.grouped_matmul_cuda,
        "swiglu": cm.swiglu_matmul_cuda,
    }

    def checked(kind):
        def call(x, *ws, norm=None, **kw):
            got = real[kind](x, *ws, norm=norm, **kw)
            if norm is None:
                return got
            nw, eps = norm
            xn = mx.fast.rms_norm(x, nw, eps)
            want = real[kind](xn, *ws, **kw)
            pairs = list(zip(got, want)) if kind == "grouped" else [(got, want)]
            bad = [int(mx.sum(g != w).item()) for g, w in pairs]
            entry = {"kind": kind, "x": list(x.shape), "bad": bad, "eps": eps}
            if any(bad) and not found:
                K = x.shape[-1]
                eye = mx.eye(K, dtype=x.dtype)
                ours = real["single"](x, eye, norm=norm)
                plain = real["single"](xn, eye)
                for name, a in (
                    ("x", x),
                    ("nw", nw),
                    ("xn_mlx", xn),
                    ("xn_ours", ours),
                    ("xn_mlx_eye", plain),
                ):
                    np.save(args.out / f"{name}.npy", np.array(a.astype(mx.float32)))
                entry["rows_differing"] = int(mx.sum(mx.any(ours != xn, axis=-1)).item())
                entry["values_differing"] = int(mx.sum(ours != xn).item())
            if any(bad):
                found.append(entry)
            report.setdefault("checked", 0)
            report["checked"] += 1
            return got

        return call

    cm.small_matmul_cuda = checked("single")
    cm.grouped_matmul_cuda = checked("grouped")
    cm.swiglu_matmul_cuda = checked("swiglu")
    os.environ[select.NORM_MM_ENV] = "1"
    mx.disable_compile()
    report["plain 1 eager"] = toks("slots-plain")
    report["mismatches"] = found[:20]
    report["mismatch_count"] = len(found)
    print(json.dumps({k: v for k, v in report.items()}, default=str)[:4000], flush=True)
    (args.out / "norm_mm_check.json").write_text(json.dumps(report, default=str, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
