"""Compile, check and time every Gated-DeltaNet CUDA kernel variant once, on the GPU.

What it does: for each kernel variant (plain recurrence / fused conv..recurrence; per-step
states / final state / replay; float32 and bf16; one step and a 16-step block) at the
Qwen3.5-4B shapes, run it, compare it with the ops reference (relative error), and on failure run
it again with ``verbose=True`` so MLX prints the generated CUDA source next to the compiler's
error in the log. Then time the recurrence implementations against each other at the same
shapes (median of several evaluations of ``--calls`` back-to-back calls).

What it does not do: time whole models (``benchmarks/verify_cost.py`` does).

Usage (on the GPU machine): ``python3 benchmarks/gpu_smoke.py --out smoke.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf2q.kernels import cuda_gated_delta as cg  # noqa: E402
from hf2q.kernels.gdn import gated_delta_steps_ops, prepare_ops  # noqa: E402

# Qwen3.5-4B's Gated-DeltaNet: 16 key heads, 32 value heads, head dims 128, conv kernel 4.
HK, HV, DK, DV, K = 16, 32, 128, 128, 4


def rel(a: mx.array, b: mx.array) -> float:
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    if mx.isnan(a32).any().item():
        return float("nan")
    return (mx.linalg.norm(a32 - b32) / mx.linalg.norm(b32)).item()


def make_layer(dtype):
    from mlx_lm.models import qwen3_5

    args = qwen3_5.TextModelArgs(
        model_type="qwen3_5_text",
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=K,
        vocab_size=64,
    )
    mx.random.seed(0)
    attn = qwen3_5.GatedDeltaNet(args)
    if dtype != mx.float32:
        attn.set_dtype(dtype)
        attn.A_log = attn.A_log.astype(mx.float32)
    mx.eval(attn.parameters())
    return attn


def block_inputs(attn, T: int, dtype, seed: int):
    mx.random.seed(seed)
    x = mx.random.normal((1, T, 256)).astype(dtype)
    conv0 = (mx.random.normal((1, K - 1, attn.conv_dim)) * 0.5).astype(dtype)
    st0 = mx.random.normal((1, HV, DV, DK)) * 0.05
    qkv, a, b = attn.in_proj_qkv(x), attn.in_proj_a(x), attn.in_proj_b(x)
    q, k, v, g, beta = prepare_ops(attn, mx.concatenate([conv0, qkv], axis=1), a, b)
    arrays = dict(conv0=conv0, st0=st0, qkv=qkv, a=a, b=b, q=q, k=k, v=v, g=g, beta=beta)
    mx.eval(list(arrays.values()))
    return arrays


def _variant_cases(plain: tuple, fused: tuple, n: int, fkw: dict) -> dict[str, Any]:
    """Each kernel variant as ``fn(verbose) -> outputs``."""
    return {
        "steps/states": lambda v=False: cg.gated_delta_steps_cuda(
            *plain, record="states", verbose=v
        ),
        "steps/final": lambda v=False: cg.gated_delta_steps_cuda(*plain, record="final", verbose=v),
        "steps/replay": lambda v=False: cg.gated_delta_steps_cuda(
            *plain, record="final", steps=n, verbose=v
        ),
        "fused/states": lambda v=False: cg.gdn_fused_cuda(
            *fused, record="states", verbose=v, **fkw
        ),
        "fused/final": lambda v=False: cg.gdn_fused_cuda(*fused, record="final", verbose=v, **fkw),
        "fused/replay": lambda v=False: cg.gdn_fused_cuda(
            *fused, record="final", steps=n, verbose=v, **fkw
        ),
    }


def _timed_impls(plain: tuple, fused: tuple, T: int, fkw: dict) -> dict[str, Any]:
    """The recurrence implementations to time, as zero-argument functions."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    half = max(1, T // 2)
    return {
        "mlx-lm gated_delta_ops (per-step loop)": lambda: gated_delta_ops(*plain),
        "ops reference with per-step states": lambda: gated_delta_steps_ops(*plain),
        "mx.fast.gated_delta_update": lambda: mx.fast.gated_delta_update(*plain),
        "cuda steps, per-step states": lambda: cg.gated_delta_steps_cuda(*plain, record="states"),
        "cuda steps, final state": lambda: cg.gated_delta_steps_cuda(*plain, record="final"),
        "cuda fused, per-step states": lambda: cg.gdn_fused_cuda(*fused, record="states", **fkw),
        "cuda fused, final state": lambda: cg.gdn_fused_cuda(*fused, record="final", **fkw),
        "cuda fused, replay n=T/2": lambda: cg.gdn_fused_cuda(
            *fused, record="final", steps=half, **fkw
        ),
    }


def check_variants(log) -> list[dict[str, Any]]:
    rows = []
    shown: set[str] = set()
    for dtype in (mx.float32, mx.bfloat16):
        attn = make_layer(dtype)
        fkw = dict(num_k_heads=HK, key_dim=DK, num_v_heads=HV, value_dim=DV)
        for T in (16, 1):
            d = block_inputs(attn, T, dtype, seed=T)
            y_ref, states_ref = gated_delta_steps_ops(
                d["q"], d["k"], d["v"], d["g"], d["beta"], d["st0"]
            )
            mx.eval(y_ref, states_ref)
            plain = (d["q"], d["k"], d["v"], d["g"], d["beta"], d["st0"])
            fused = (
                d["conv0"],
                d["qkv"],
                attn.conv1d.weight,
                d["a"],
                d["b"],
                attn.A_log,
                attn.dt_bias,
                d["st0"],
            )
            n = max(1, T // 2)
            cases = _variant_cases(plain, fused, n, fkw)
            for name, fn in cases.items():
                row: dict[str, Any] = {"variant": name, "dtype": str(dtype), "T": T}
                try:
                    out = fn()
                    mx.eval(out)
                    if name.endswith("replay"):
                        row["rel_state"] = rel(out, states_ref[:, n - 1])
                    else:
                        y, rec = out
                        row["rel_y"] = rel(y, y_ref)
                        want = states_ref if name.endswith("states") else states_ref[:, -1]
                        row["rel_state"] = rel(rec, want)
                    row["ok"] = True
                except Exception as exc:
                    row["ok"] = False
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"FAILED {name} {dtype} T={T}: {exc}")
                    log(traceback.format_exc())
                    if name not in shown:  # the generated source once per variant
                        shown.add(name)
                        log("---- generated source (verbose re-run) ----")
                        try:
                            mx.eval(fn(True))
                        except Exception as exc2:
                            log(f"(verbose re-run failed too: {str(exc2)[:300]})")
                log(json.dumps(row))
                rows.append(row)
    return rows


def timings(calls: int, reps: int, log) -> dict[str, Any]:
    """Median time per call of each recurrence implementation at the 4B shapes, bf16."""
    dtype = mx.bfloat16
    attn = make_layer(dtype)
    fkw = dict(num_k_heads=HK, key_dim=DK, num_v_heads=HV, value_dim=DV)
    out: dict[str, Any] = {}
    # 16: a verify block; 1: a decode step; 512: a prompt chunk (prefill; few calls, few reps).
    for T, n_calls, n_reps in ((16, calls, reps), (1, calls, reps), (512, 1, 3)):
        d = block_inputs(attn, T, dtype, seed=100 + T)
        plain = (d["q"], d["k"], d["v"], d["g"], d["beta"], d["st0"])
        fused = (
            d["conv0"],
            d["qkv"],
            attn.conv1d.weight,
            d["a"],
            d["b"],
            attn.A_log,
            attn.dt_bias,
            d["st0"],
        )
        impls = _timed_impls(plain, fused, T, fkw)
        if T > 16:  # per-step states of a long prompt are not what prefill records
            keep = ("mlx-lm gated_delta_ops (per-step loop)", "mx.fast.gated_delta_update")
            impls = {k: f for k, f in impls.items() if k in keep or "final" in k}
        res = {}
        for name, fn in impls.items():
            try:
                for _ in range(2):
                    mx.eval([fn() for _ in range(n_calls)])
                times = []
                for _ in range(n_reps):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    mx.eval([fn() for _ in range(n_calls)])
                    mx.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3 / n_calls)
                res[name] = {
                    "per_call_ms": statistics.median(times),
                    "spread_ms": max(times) - min(times),
                }
                log(f"T={T:3d} {name:42s} {statistics.median(times) * 1e3:9.1f} us/call")
            except Exception as exc:
                res[name] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"T={T:3d} {name:42s} ERROR {str(exc)[:500]}")
        out[f"T{T}"] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    info = {
        "mlx": mx.__version__,
        "cuda": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
        "device": {k: str(v) for k, v in mx.device_info().items()},
    }
    log(json.dumps(info))
    result: dict[str, Any] = {"info": info}
    t0 = time.perf_counter()
    try:
        result["checks"] = check_variants(log)
    except Exception as exc:
        result["checks_error"] = traceback.format_exc()
        log(f"checks crashed: {exc}")
    result["checks_s"] = time.perf_counter() - t0
    try:
        result["timings"] = timings(args.calls, args.reps, log)
    except Exception as exc:
        result["timings_error"] = traceback.format_exc()
        log(f"timings crashed: {exc}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    bad = [r for r in result.get("checks", []) if not r.get("ok")]
    worst = max(
        (
            r.get("rel_state", 0.0)
            for r in result.get("checks", [])
            if r.get("ok") and "float32" in r["dtype"]
        ),
        default=float("nan"),
    )
    log(
        f"variants: {len(result.get('checks', []))} checked, {len(bad)} failed; worst float32 state error {worst:.2e}"
    )
    return 1 if bad or "checks_error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
