"""Are MLX's quantized products row-invariant? (what lossless DFlash on a quantized target needs)

DFlash at temperature 0 gives plain greedy decoding's tokens only if each verify row is computed
with the bits of the decode step at that position. For unquantized bf16 weights hf2q runs its own
row-invariant product kernel in both (``hf2q.kernels.cuda_matmul``); quantized layers run MLX's
``quantized_matmul``, whose CUDA backend picks its kernel by the number of rows (MLX 0.32: on
sm_90 a matrix-vector kernel for exactly one row, a CUTLASS GEMM with a row tile of 16, 32, 64,
128 or 256 otherwise). This script asks the device directly, for the Qwen3.5-4B product shapes:

* rows: for M in ``--rows``, ``y_M = quantized_matmul(x[:M])`` with the same ``x``; for each M,
  whether its rows are bit-equal to the one-row products (what plain decoding computes) and to
  the rows of every other M (what a verify of that many rows computes);
* time: microseconds per product at each M (``--ops`` products per evaluation, medians);
* with ``--kernel`` (CUDA), the same for hf2q's dequantizing small-M kernel
  (``hf2q.kernels.cuda_matmul.small_qmatmul_cuda``, what hf2q's decoding paths run).

    python benchmarks/quant_rows.py --bits 4,8 --rows 1,2,3,8,16,17,32,64 --out q.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

# (N, K) of the Qwen3.5-4B target's products (benchmarks/shapes.py): MLP gate/up and down,
# Gated-DeltaNet's input and output projections, attention's gated q and k/v, the tied head.
SHAPES = {
    "4b": [(9216, 2560), (2560, 9216), (12288, 2560), (2560, 4096), (8192, 2560), (1024, 2560)],
    "head": [(248320, 2560)],
    "small": [(256, 128), (128, 256)],
}


def _qmm(x, q, bits: int, group: int, kernel: bool | tuple = False):
    wq, scales, biases = q
    if kernel:
        from hf2q.kernels.cuda_matmul import small_qmatmul_cuda

        tune = kernel if isinstance(kernel, tuple) else None
        return small_qmatmul_cuda(x, wq, scales, biases, bits=bits, group=group, tune=tune)
    return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)


def rows_check(
    N: int, K: int, bits: int, group: int, rows: list[int], dtype, kernel: bool = False
) -> dict:
    """Bit-equality of the rows of ``y_M`` against one-row products and against each other M."""
    mx.random.seed(N * 7 + K + bits)
    w = (mx.random.normal((N, K)) * K**-0.5).astype(dtype)
    q = mx.quantize(w, group_size=group, bits=bits)
    most = max(rows)
    x = mx.random.normal((1, most, K)).astype(dtype)
    ones = mx.concatenate(
        [_qmm(x[:, i : i + 1], q, bits, group, kernel) for i in range(most)], axis=1
    )
    ys = {m: _qmm(x[:, :m], q, bits, group, kernel) for m in rows}
    mx.eval(ones, *ys.values())
    out = {}
    for m, y in ys.items():
        as_decode = mx.equal(y, ones[:, :m]).all(axis=-1)[0]
        row = {
            "rows_equal_one_row_products": int(as_decode.sum().item()),
            "rows": m,
            "max_abs_diff_to_one_row": float(
                mx.abs(y.astype(mx.float32) - ones[:, :m].astype(mx.float32)).max().item()
            ),
        }
        for m2, y2 in ys.items():
            if m2 > m:  # the first m rows of a larger block
                row[f"equal_first_rows_of_{m2}"] = bool(mx.array_equal(y, y2[:, :m]).item())
        out[str(m)] = row
    return out


def _weight_set(N: int, K: int, bits: int, group: int, dtype, ops: int) -> list:
    """``ops`` distinct quantized (N, K) weights (so that no product of a timed evaluation runs
    from the cache of the one before), evaluated."""
    mx.random.seed(1)
    qs = [
        mx.quantize((mx.random.normal((N, K)) * K**-0.5).astype(dtype), group_size=group, bits=bits)
        for _ in range(ops)
    ]
    mx.eval(qs)
    return qs


def timing(
    N: int,
    K: int,
    bits: int,
    group: int,
    rows: list[int],
    dtype,
    ops: int,
    reps: int,
    kernel: bool | tuple = False,
):
    qs = _weight_set(N, K, bits, group, dtype, ops)
    out = {}
    for m in rows:
        x = mx.random.normal((1, m, K)).astype(dtype)
        mx.eval(x)
        times = []
        for r in range(reps + 1):
            tic = time.perf_counter()
            mx.eval([_qmm(x, q, bits, group, kernel) for q in qs])
            if r:
                times.append((time.perf_counter() - tic) / ops * 1e6)
        out[str(m)] = round(statistics.median(times), 2)
    del qs
    mx.clear_cache()
    return out


def _one(N: int, K: int, bits: int, kernel: bool, rows: list[int], dtype, args) -> dict:
    """One product shape, quantization and implementation: its rows and times, printed."""
    who = "hf2q kernel" if kernel else "MLX"
    rec = {"N": N, "K": K, "bits": bits, "group": args.group, "impl": who}
    rec["rows"] = rows_check(N, K, bits, args.group, rows, dtype, kernel)
    if not args.no_time:
        ops = args.ops if N * K < 1e8 else 2
        rec["us_per_product"] = timing(N, K, bits, args.group, rows, dtype, ops, args.reps, kernel)
    eq = ",".join(f"{m}:{r['rows_equal_one_row_products']}/{m}" for m, r in rec["rows"].items())
    print(f"{N}x{K} {bits}-bit {who}: rows equal to one-row products {eq}", flush=True)
    same = [
        f"{m}<{k[len('equal_first_rows_of_') :]}"
        for m, r in rec["rows"].items()
        for k, v in r.items()
        if k.startswith("equal_first_rows_of_") and not v
    ]
    print(f"   blocks whose rows differ from a larger block's: {same or 'none'}")
    if "us_per_product" in rec:
        print(f"   us a product by rows: {rec['us_per_product']}", flush=True)
    return rec


def _tune(args) -> int:
    """us a product of the dequantizing kernel for each launch of ``--tune``, in turn (each
    launch's products of one evaluation timed round-robin with the others, medians), the row
    counts in the order given."""
    rows = list(dict.fromkeys(int(r) for r in args.rows.split(",")))
    dtype = getattr(mx, args.dtype)
    cands = [tuple(int(v) for v in c.split(",")) for c in args.tune.split(";")]
    out = []
    for shape in args.shapes.split(","):
        for N, K in SHAPES[shape]:
            for bits in (int(b) for b in args.bits.split(",")):
                ops = args.ops if N * K < 1e8 else 2
                qs = _weight_set(N, K, bits, args.group, dtype, ops)
                for m in rows:
                    x = mx.random.normal((1, m, K)).astype(dtype)
                    mx.eval(x)
                    # (past two m-tiles, 8 column blocks or 16 warps ask more registers than
                    # a launch has: session 34)
                    fit = [c for c in cands if m <= 32 or (c[0] <= 4 and c[1] <= 8)]
                    kinds = [("mlx", False), ("default", True)] + [
                        (",".join(map(str, c)), c) for c in fit
                    ]
                    times: dict[str, list[float]] = {k: [] for k, _ in kinds}
                    for r in range(args.reps + 1):
                        for k, kern in kinds:
                            try:
                                tic = time.perf_counter()
                                mx.eval([_qmm(x, q, bits, args.group, kern) for q in qs])
                                if r:
                                    times[k].append((time.perf_counter() - tic) / ops * 1e6)
                            except ValueError:
                                times[k] = []
                    row = {
                        "N": N,
                        "K": K,
                        "bits": bits,
                        "rows": m,
                        "us": {k: round(statistics.median(v), 2) for k, v in times.items() if v},
                    }
                    out.append(row)
                    best = sorted(row["us"].items(), key=lambda kv: kv[1])[:6]
                    print(f"{N}x{K} {bits}-bit {m} rows: {best}", flush=True)
                    if args.out:  # after each row count: a run cut by its time limit keeps these
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        doc = {"mlx": mx.__version__, "tune": out}
                        args.out.write_text(json.dumps(doc, indent=2) + "\n")
                del qs
                mx.clear_cache()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4b", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--rows", default="1,2,3,8,16,17,32,33,64")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--ops", type=int, default=8, help="products per timed evaluation")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument(
        "--kernel", action="store_true", help="also hf2q's dequantizing small-M kernel (CUDA)"
    )
    ap.add_argument(
        "--tune",
        default="",
        help="time the kernel's launches instead: ';'-separated nb,warps,unroll (at every row count)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.tune:
        return _tune(args)
    rows = sorted({int(r) for r in args.rows.split(",")})
    dtype = getattr(mx, args.dtype)
    results = []
    for shape in args.shapes.split(","):
        for N, K in SHAPES[shape]:
            for bits in (int(b) for b in args.bits.split(",")):
                for kernel in (False, True) if args.kernel else (False,):
                    results.append(_one(N, K, bits, kernel, rows, dtype, args))
    report = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "dtype": args.dtype,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
