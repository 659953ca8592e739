"""What one DFlash round costs against one plain decode step, and where verify time goes.

Builds a Qwen3.5 target of the real Qwen3.5-4B shape through mlx-lm's own classes with random
weights (bf16, and 4-bit through ``nn.quantize``), fills its caches as after a 1024-token context,
builds a drafter of the real Qwen3.5-4B DFlash drafter's shape (``DFlashDraftModel``, 5 layers),
and reports, as medians:

* decode-1: one plain decode step (stock mlx-lm, and hf2q's layer path with each kernel choice);
* verify-16: one target forward over a 16-token block capturing the drafter's features, with
  argmax; for stock mlx-lm and for each implementation of the Gated-DeltaNet layers;
* rollback: restoring every layer's cache to n kept tokens (n = 8) from the verify record (the
  runtime's in one launch where ``select.rollback_kernel_enabled()``; ``rollback_per_layer``
  times it with ops per layer, for scale);
* draft-16: one drafter forward over a 16-token block with 8 new context rows, plus argmax;
* E = t(decode-1) / t(draft-16 + verify-16 + rollback), against stock decode and against the
  same implementation's decode;
* decode-1 against the bandwidth floor (bytes read per token / copy bandwidth measured here);
* a per-op profile: each sublayer piece of a Gated-DeltaNet layer, an attention layer and the head
  timed in isolation with the same shapes, times the number of such layers.

Shapes (Qwen3.5-4B, from its config.json: hidden 2560, 32 layers, full attention every 4th,
16 query / 4 key-value heads of 256, MLP 9216, linear attention 16 key heads and 32 value heads
of 128, conv kernel 4, vocab 248320, tied embeddings, rope theta 1e7 on a quarter of the dims;
the z-lab drafter: 5 layers, 32 / 8 heads of 128, MLP 9728, target layers [1, 8, 15, 22, 29]).
``--small`` shrinks everything for a CPU.

What it does not do: load real checkpoints or measure acceptance (tau); speedup = tau x E.

Usage::

    python benchmarks/verify_cost.py --out runs/verify_cost.json            # GPU, 4B shapes
    python benchmarks/verify_cost.py --small --dtypes float32 --out cpu.json  # CPU
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN35_4B_DRAFTER, QWEN35_4B_TARGET  # noqa: E402

from hf2q.kernels import select  # noqa: E402
from hf2q.kernels.attention import compile_attention_layer  # noqa: E402
from hf2q.kernels.gdn import (  # noqa: E402
    compile_gdn_decoder_layer,
    fuse_projections,
    gated_delta_steps_ops,
    gdn_decoder_layer,
    rollback,
)
from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel, default_target_layer_ids  # noqa: E402
from hf2q.runtime.target import TargetModel  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "4b": {
        "target": dict(QWEN35_4B_TARGET),
        "drafter": dict(QWEN35_4B_DRAFTER, rope_theta=10000000.0),
    },
    "small": {
        "target": dict(
            hidden_size=512,
            num_hidden_layers=8,
            full_attention_interval=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1536,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=16384,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            rope_parameters={
                "type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
        ),
        "drafter": dict(
            num_hidden_layers=5,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1536,
            target_layer_ids=default_target_layer_ids(8, 5),
            mask_token_id=16000,
            rope_theta=10000000.0,
        ),
    },
}

DTYPES = {"bf16": mx.bfloat16, "float32": mx.float32, "4bit": "4bit"}


# -- timing --------------------------------------------------------------------------------------


def _sync() -> None:
    mx.synchronize()


def measure(
    fn: Callable[[], Any],
    *,
    reps: int,
    warmup: int,
    after: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Median wall time of ``fn`` (which evaluates its own outputs), in milliseconds.

    ``after`` runs outside the timed region after every call (cache restore).
    """
    times = []
    for i in range(warmup + reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        dt = (time.perf_counter() - t0) * 1e3
        if after is not None:
            after()
        if i >= warmup:
            times.append(dt)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p10_ms": times[max(0, len(times) // 10)],
        "p90_ms": times[min(len(times) - 1, (len(times) * 9) // 10)],
        "reps": reps,
    }


def copy_bandwidth(nbytes: int, reps: int) -> dict[str, Any]:
    """Device copy bandwidth: ``y = x + 1`` over a large float32 array, (read + write) / time."""
    n = nbytes // 4
    xs = [mx.random.uniform(shape=(n,)) for _ in range(2)]  # two buffers: no cache reuse
    mx.eval(xs)
    i = [0]

    def run():
        i[0] += 1
        mx.eval(xs[i[0] % 2] + 1.0)

    res = measure(run, reps=reps, warmup=2)
    res["bytes_moved"] = 2 * n * 4
    res["GB_per_s"] = res["bytes_moved"] / (res["median_ms"] * 1e-3) / 1e9
    return res


# -- models --------------------------------------------------------------------------------------


def build_target(shape: str, dtype_name: str, seed: int = 0) -> TargetModel:
    from mlx_lm.models import qwen3_5

    cfg = dict(SHAPES[shape]["target"])
    cfg["model_type"] = "qwen3_5_text"
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=cfg))
    float_dtype = mx.bfloat16 if dtype_name in ("bf16", "4bit") else mx.float32
    cast = model.language_model.cast_predicate  # False for A_log, which stays float32
    from mlx.utils import tree_flatten, tree_unflatten

    params = tree_flatten(model.parameters())
    model.update(tree_unflatten([(k, v.astype(float_dtype) if cast(k) else v) for k, v in params]))
    if dtype_name == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    model.eval()
    mx.eval(model.parameters())
    return TargetModel(model)


def build_drafter(shape: str, target: TargetModel, dtype, seed: int = 1) -> DFlashDraftModel:
    d = dict(SHAPES[shape]["drafter"])
    t = SHAPES[shape]["target"]
    cfg = DFlashConfig(
        hidden_size=t["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"],
        intermediate_size=d["intermediate_size"],
        vocab_size=t["vocab_size"],
        num_target_layers=t["num_hidden_layers"],
        target_layer_ids=d["target_layer_ids"],
        mask_token_id=d["mask_token_id"],
        rope_theta=d["rope_theta"],
    )
    mx.random.seed(seed)
    drafter = DFlashDraftModel(cfg)
    drafter.set_dtype(dtype)
    drafter.eval()
    mx.eval(drafter.parameters())
    return drafter.bind(target.embed, target.head)


def fill_target_cache(
    target: TargetModel, ctx: int, dtype, seed: int = 2, cache: list[Any] | None = None
) -> list[Any]:
    """Caches holding ``ctx`` positions of (random) context, as after a prefill.

    ``cache``: an empty cache list to fill (default: mlx-lm's own, ``target.make_cache()``).
    """
    mx.random.seed(seed)
    cache = target.make_cache() if cache is None else cache
    for i, layer in enumerate(target.layers):
        if target.is_linear(i):
            attn = layer.linear_attn
            cache[i][0] = (
                mx.random.normal((1, attn.conv_kernel_size - 1, attn.conv_dim)) * 0.5
            ).astype(dtype)
            cache[i][1] = (
                mx.random.normal((1, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim)) * 0.05
            )
        else:
            sa = layer.self_attn
            shape = (1, sa.num_key_value_heads, ctx, sa.head_dim)
            k = mx.random.normal(shape).astype(dtype)
            v = mx.random.normal(shape).astype(dtype)
            cache[i].update_and_fetch(k, v)
    mx.eval([c.state for c in cache])
    return cache


def snapshot(cache: list[Any]) -> list[Any]:
    return [(c[0], c[1]) if hasattr(c, "cache") else c.offset for c in cache]


def restore(cache: list[Any], snap: list[Any]) -> None:
    for c, s in zip(cache, snap):
        if hasattr(c, "cache"):
            c[0], c[1] = s
            if hasattr(c, "record"):  # the runtime's GDNRollbackCache
                c.record = None
        else:
            c.offset = s
    if hasattr(cache, "pending"):  # the runtime's TargetCache
        cache.pending = 0


def weight_bytes_per_token(target: TargetModel) -> int:
    """Bytes of parameters one decode step reads (the embedding matrix once, as the tied head)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))


def state_bytes_per_token(target: TargetModel, ctx: int, itemsize: int) -> int:
    """Cache bytes one decode step moves: KV read, Gated-DeltaNet state read + write, conv state."""
    total = 0
    for i, layer in enumerate(target.layers):
        if target.is_linear(i):
            a = layer.linear_attn
            total += 2 * a.num_v_heads * a.head_v_dim * a.head_k_dim * 4
            total += 2 * (a.conv_kernel_size - 1) * a.conv_dim * itemsize
        else:
            sa = layer.self_attn
            total += 2 * sa.num_key_value_heads * sa.head_dim * ctx * itemsize
    return total


# -- verify / decode paths ---------------------------------------------------------------------------


class LayerFnPath:
    """hf2q's target path: TargetModel.forward with a layer_fn running the GDN layers as functions.

    Options: ``impl``/``record`` of the Gated-DeltaNet layers (see hf2q.kernels.gdn);
    ``compiled``: GDN layers under mx.compile and attention layers in compiled pieces
    (hf2q.kernels.attention); ``fuse_proj``: concatenated input projections (fewer matmuls).
    Until the runtime's public verify exists this is the verify under test; the runtime's own
    path plugs in through :func:`paths_for` (one line).
    """

    def __init__(
        self,
        target: TargetModel,
        *,
        impl: str,
        record: str,
        compiled: bool,
        fuse_proj: bool = False,
        mm: bool = False,
        rows: bool = False,
    ) -> None:
        self.target, self.impl, self.record = target, impl, record
        self.compiled, self.fuse_proj, self.mm, self.rows = compiled, fuse_proj, mm, rows
        self.records: dict[int, Any] = {}
        self._gdn: dict[int, Callable] = {}
        self._attn: dict[int, Callable] = {}
        self._fused: dict[int, Any] = {}
        if fuse_proj:
            for i in target.linear_layers:
                self._fused[i] = fuse_projections(target.layers[i])
            mx.eval([tuple(f) for f in self._fused.values()])

    def _layer(self, i: int, layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
        if layer.is_linear:
            if mask is not None:
                raise RuntimeError("padding masks are not supported by the layer-function path")
            fused = self._fused.get(i)
            if self.compiled:
                if i not in self._gdn:
                    self._gdn[i] = compile_gdn_decoder_layer(
                        layer, impl=self.impl, record=self.record, fused=fused, mm=self.mm
                    )
                out, rec = self._gdn[i](h, cache[0], cache[1])
            else:
                out, rec = gdn_decoder_layer(
                    layer,
                    h,
                    cache[0],
                    cache[1],
                    impl=self.impl,
                    record=self.record,
                    fused=fused,
                    mm=self.mm,
                )
            self.records[i] = rec
            cache[0], cache[1] = rec.final_conv_state, rec.final_state
            return out
        if self.compiled:
            if i not in self._attn:
                self._attn[i] = compile_attention_layer(
                    layer, fuse_proj=self.fuse_proj, mm=self.mm, rows=self.rows
                )
            return self._attn[i](h, mask, cache)
        return layer(h, mask=mask, cache=cache)

    def make_cache(self) -> list[Any]:
        return self.target.make_cache()

    def forward(self, tokens: mx.array, cache: list[Any], capture: list[int]):
        return self.target.forward(tokens, cache, capture=capture, layer_fn=self._layer, mm=self.mm)

    def rollback(self, cache: list[Any], n: int, T: int) -> list[mx.array]:
        out = []
        for i, c in enumerate(cache):
            if i in self.records:
                conv, st = rollback(
                    self.target.layers[i].linear_attn, self.records[i], n, impl=self.impl
                )
                c[0], c[1] = conv, st
                out += [conv, st]
            else:
                c.trim(T - n)
        return out


class RuntimePath:
    """The runtime's public verify (``hf2q.runtime.verify.verify_forward`` on its ``TargetCache``,
    rolled back with ``TargetCache.rollback``); decode is the runtime's plain step (its layer
    function ``decode_layer_fn()``: the compiled runners on CUDA, mlx-lm's forward elsewhere)."""

    def __init__(self, target: TargetModel) -> None:
        from hf2q.kernels.layers import decode_layer_fn
        from hf2q.runtime.verify import verify_forward

        self.target, self._verify, self._decode = target, verify_forward, decode_layer_fn()

    def make_cache(self) -> list[Any]:
        from hf2q.runtime.cache import make_target_cache

        return make_target_cache(self.target.model)

    def forward(self, tokens: mx.array, cache: Any, capture: list[int]):
        if tokens.shape[1] == 1:
            return self.target.forward(tokens, cache, capture=capture, layer_fn=self._decode)
        return self._verify(self.target, tokens, cache, capture=capture)

    def rollback(self, cache: Any, n: int, T: int) -> list[mx.array]:
        cache.rollback(n)
        return [c.state for c in cache]


class RuntimeWholePath(RuntimePath):
    """:class:`RuntimePath` as the runtime's rounds run it on CUDA: the verify of a full block
    as one compiled graph (``hf2q.runtime.verify.whole_verify``, ``HF2Q_COMPILE_VERIFY``), made
    once per block length (where it does not apply, the layer path, as ``runtime``)."""

    def __init__(self, target: TargetModel) -> None:
        super().__init__(target)
        self._whole: dict[tuple, Any] = {}

    def forward(self, tokens: mx.array, cache: Any, capture: list[int]):
        from hf2q.runtime.verify import whole_verify

        T = tokens.shape[1]
        if T == 1:
            return super().forward(tokens, cache, capture)
        key = (T, tuple(capture))
        if key not in self._whole:
            self._whole[key] = whole_verify(self.target, cache, T, capture)
        return self._verify(self.target, tokens, cache, capture=capture, whole=self._whole[key])


class StockPath:
    """mlx-lm's own layer calls (what plain mlx-lm runs); no exact rollback exists for it."""

    def __init__(self, target: TargetModel) -> None:
        self.target = target

    def make_cache(self) -> list[Any]:
        return self.target.make_cache()

    def forward(self, tokens: mx.array, cache: list[Any], capture: list[int]):
        return self.target.forward(tokens, cache, capture=capture)

    def rollback(self, cache: list[Any], n: int, T: int) -> list[mx.array]:
        raise NotImplementedError("mlx-lm's ArraysCache cannot be rolled back")


def _path(impl: str, record: str, compiled: bool, **switches: bool) -> Callable[..., LayerFnPath]:
    """A :class:`LayerFnPath` constructor (``switches``: its ``fuse_proj`` / ``mm`` / ``rows``)."""
    return functools.partial(LayerFnPath, impl=impl, record=record, compiled=compiled, **switches)


def paths_for(backend: str) -> dict[str, Callable[[TargetModel], Any]]:
    """The target paths to compare on this backend (name -> constructor)."""
    paths: dict[str, Callable[[TargetModel], Any]] = {
        "stock": StockPath,
        "ops-states": _path("ops", "states", False),
        "ops-final": _path("ops", "final", False),
        "ops-compiled-states": _path("ops", "states", True),
        "ops-compiled-final": _path("ops", "final", True),
        "ops-compiled-final+proj": _path("ops", "final", True, fuse_proj=True),
    }
    if backend == "cuda":
        paths.update(
            {
                "cuda_steps-states": _path("cuda_steps", "states", False),
                "fused-states": _path("cuda", "states", False),
                "fused-final": _path("cuda", "final", False),
                "fused-compiled-states": _path("cuda", "states", True),
                "fused-compiled-final": _path("cuda", "final", True),
                "fused-compiled-states+proj": _path("cuda", "states", True, fuse_proj=True),
                "fused-compiled-final+proj": _path("cuda", "final", True, fuse_proj=True),
                # products through hf2q's small-M tensor-core kernel (hf2q.kernels.linear)
                "fused-compiled-states+mm": _path("cuda", "states", True, mm=True),
                "fused-compiled-final+mm": _path("cuda", "final", True, mm=True),
                # and attention through the row-invariant kernel (hf2q.kernels.cuda_attention)
                "fused-compiled-states+mm+rows": _path("cuda", "states", True, mm=True, rows=True),
                "fused-compiled-final+mm+rows": _path("cuda", "final", True, mm=True, rows=True),
            }
        )
    if importlib.util.find_spec("hf2q.runtime.verify") is not None:
        paths["runtime"] = RuntimePath  # the runtime's public verify, where it exists
        paths["runtime-whole"] = RuntimeWholePath
    return paths


#: Paths timed for the second and later dtypes (the full set runs for the first one).
QUICK_PATHS = (
    "stock",
    "runtime",
    "runtime-whole",
    "ops-states",
    "ops-compiled-final+proj",
    "fused-states",
    "fused-compiled-final",
    "fused-compiled-states+proj",
    "fused-compiled-final+proj",
)


# -- the benchmark -------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def guarded(results: dict, key: str, fn: Callable[[], Any], budget: Budget, log) -> Any:
    """Run one measurement; record its result or its error and go on."""
    if budget.left() <= 0:
        results[key] = {"skipped": "time budget spent"}
        log(f"  {key}: skipped (time budget)")
        return None
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # one failing part must not stop the others
        results[key] = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        log(f"  {key}: ERROR {type(exc).__name__}: {str(exc)[:2000]}")
        return None
    results[key] = value
    if isinstance(value, dict) and "median_ms" in value:
        log(f"  {key}: {value['median_ms']:.3f} ms  ({time.perf_counter() - t0:.1f} s)")
    return value


class PathRun:
    """One target path with its own cache, restored to the same context after every timed step."""

    def __init__(
        self, name: str, path: Any, cache: list[Any], tokens, capture, T: int, n_keep: int
    ):
        self.name, self.path, self.cache = name, path, cache
        self.tok1, self.tok16 = tokens
        self.capture, self.T, self.n_keep = capture, T, n_keep
        self.snap = snapshot(cache)

    def reset(self) -> None:
        restore(self.cache, self.snap)

    def _timed(self, fn: Callable[[], Any]) -> float:
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        return (time.perf_counter() - t0) * 1e3

    def _decode(self) -> None:
        logits, _ = self.path.forward(self.tok1, self.cache, [])
        mx.eval(mx.argmax(logits[:, -1], axis=-1), [c.state for c in self.cache])

    def _verify(self) -> None:
        logits, feats = self.path.forward(self.tok16, self.cache, self.capture)
        mx.eval(mx.argmax(logits, axis=-1), feats, [c.state for c in self.cache])

    def decode(self) -> float:
        dt = self._timed(self._decode)
        self.reset()
        return dt

    def verify(self) -> float:
        dt = self._timed(self._verify)
        self.reset()
        return dt

    def rollback(self) -> float:
        self._verify()
        dt = self._timed(lambda: mx.eval(self.path.rollback(self.cache, self.n_keep, self.T)))
        self.reset()
        return dt

    def rollback_per_layer(self) -> float:
        """The rollback with ``HF2Q_ROLLBACK_KERNEL=0``: each layer with ops, not one launch."""
        before = os.environ.get(select.ROLLBACK_KERNEL_ENV)
        os.environ[select.ROLLBACK_KERNEL_ENV] = "0"
        try:
            return self.rollback()
        finally:
            if before is None:
                del os.environ[select.ROLLBACK_KERNEL_ENV]
            else:
                os.environ[select.ROLLBACK_KERNEL_ENV] = before


def interleaved(runs: list[PathRun], phase: str, key: str, args, results, budget, log) -> None:
    """Time ``phase`` of every path round-robin (so load changes hit all paths alike); medians."""
    active = list(runs)
    times: dict[str, list[float]] = {r.name: [] for r in runs}
    for i in range(args.warmup + args.reps):
        if budget.left() <= 0:
            break
        for run in list(active):
            try:
                dt = getattr(run, phase)()
            except Exception as exc:  # one failing path must not stop the others
                results[f"{key}/{run.name}"] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
                log(f"  {key}/{run.name}: ERROR {type(exc).__name__}: {str(exc)[:2000]}")
                active.remove(run)
                run.reset()
                continue
            if i >= args.warmup:
                times[run.name].append(dt)
    for run in active:
        t = sorted(times[run.name])
        if not t:
            results[f"{key}/{run.name}"] = {"skipped": "time budget spent"}
            continue
        results[f"{key}/{run.name}"] = {
            "median_ms": statistics.median(t),
            "p10_ms": t[len(t) // 10],
            "p90_ms": t[min(len(t) - 1, (len(t) * 9) // 10)],
            "reps": len(t),
        }
        log(f"  {key}/{run.name}: {statistics.median(t):.3f} ms (p10 {t[len(t) // 10]:.3f})")


def bench_paths(target, drafter, args, dtype, results, budget, log, quick: bool = False) -> None:
    T, ctx = args.block, args.context
    capture = list(drafter.config.target_layer_ids)
    vocab = target.vocab_size
    mx.random.seed(3)
    tok1 = mx.random.randint(0, vocab, (1, 1))
    tok16 = mx.random.randint(0, vocab, (1, T))
    backend = select.backend()
    runs: list[PathRun] = []
    for name, make in paths_for(backend).items():
        if args.paths and name not in args.paths:
            continue
        if quick and name not in QUICK_PATHS:
            continue
        try:
            path = make(target)
        except Exception as exc:
            results[f"build/{name}"] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            log(f"  build/{name}: ERROR {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        # Every path starts from the same (seeded) context in a cache of its own kind.
        cache = fill_target_cache(target, ctx, dtype, cache=path.make_cache())
        runs.append(PathRun(name, path, cache, (tok1, tok16), capture, T, args.keep))
    interleaved(runs, "decode", "decode1", args, results, budget, log)
    interleaved(runs, "verify", f"verify{T}", args, results, budget, log)
    with_rollback = [r for r in runs if r.name != "stock"]
    interleaved(with_rollback, "rollback", "rollback", args, results, budget, log)
    one_launch = (
        [r for r in runs if r.name == "runtime"] if select.rollback_kernel_enabled() else []
    )
    if one_launch:  # the same rollback per layer with ops, for scale
        interleaved(
            one_launch, "rollback_per_layer", "rollback_per_layer", args, results, budget, log
        )
    runs.clear()

    # draft-16: drafter forward over [last, MASK x 15] with 8 new context rows, and argmax.
    def draft_bench():
        dcache = drafter.make_cache()
        feats_ctx = (mx.random.normal((1, ctx, len(capture) * target.hidden_size)) * 0.5).astype(
            dtype
        )
        mx.eval(drafter.hidden(tok16[:, :1], feats_ctx, dcache), [c.state for c in dcache])
        new_rows = args.new_context
        feats = (mx.random.normal((1, new_rows, len(capture) * target.hidden_size)) * 0.5).astype(
            dtype
        )
        block = mx.concatenate(
            [tok16[:, :1], mx.full((1, T - 1), drafter.mask_token_id, dtype=tok16.dtype)], axis=1
        )

        def draft():
            logits = drafter(block, feats, dcache)
            mx.eval(mx.argmax(logits, axis=-1))

        def draft_layer_calls():
            logits = drafter._head(drafter.hidden(block, feats, dcache, fast=False)[:, 1:])
            mx.eval(mx.argmax(logits, axis=-1))

        def trim():
            for c in dcache:
                c.trim(new_rows)

        out = measure(draft, reps=args.reps, warmup=args.warmup, after=trim)
        if drafter.fast_enabled():  # the same forward through each layer's own call, for scale
            slow = measure(draft_layer_calls, reps=args.reps, warmup=args.warmup, after=trim)
            out["layer_calls_median_ms"] = slow["median_ms"]
            log(f"  draft{T} through the layers' own calls: {slow['median_ms']:.3f} ms")
        return out

    guarded(results, f"draft{T}", draft_bench, budget, log)


def summarise(results: dict, T: int) -> dict[str, Any]:
    """E and ratios from the raw medians."""

    def med(key):
        v = results.get(key)
        return v.get("median_ms") if isinstance(v, dict) else None

    out: dict[str, Any] = {}
    draft = med(f"draft{T}")
    stock_decode = med("decode1/stock")
    names = sorted(
        {k.split("/", 1)[1] for k in results if k.startswith(("decode1/", f"verify{T}/"))}
    )

    def p10(key):
        v = results.get(key)
        return v.get("p10_ms") if isinstance(v, dict) else None

    for name in names:
        d, v, r = med(f"decode1/{name}"), med(f"verify{T}/{name}"), med(f"rollback/{name}")
        row: dict[str, Any] = {
            "decode1_ms": d,
            f"verify{T}_ms": v,
            "rollback_ms": r,
            f"draft{T}_ms": draft,
            "decode1_p10_ms": p10(f"decode1/{name}"),
            f"verify{T}_p10_ms": p10(f"verify{T}/{name}"),
        }
        if d and v:
            row[f"verify{T}_over_decode1"] = v / d
        if draft and v and r is not None:
            rnd = draft + v + r
            row["round_ms"] = rnd
            if stock_decode:
                row["E_vs_stock_decode"] = stock_decode / rnd
            if d:
                row["E_vs_own_decode"] = d / rnd
        out[name] = row
    return out


# -- per-op profile -------------------------------------------------------------------------------


def profile(target: TargetModel, args, dtype, budget: Budget, log) -> dict[str, Any]:
    """Time each sublayer piece in isolation (k calls per evaluation), for T=block and T=1."""
    lin = next(i for i in range(target.num_layers) if target.is_linear(i))
    att = next(i for i in range(target.num_layers) if not target.is_linear(i))
    glayer, alayer = target.layers[lin], target.layers[att]
    counts = (len(target.linear_layers), target.num_layers - len(target.linear_layers))
    out: dict[str, Any] = {}
    for T in (args.block, 1):
        if budget.left() <= 0:
            out[f"T{T}"] = {"skipped": "time budget spent"}
            continue
        out[f"T{T}"] = _profile_block(target, glayer, alayer, T, args, dtype, budget, log, counts)
    return out


def _profile_block(target, glayer, alayer, T, args, dtype, budget, log, counts) -> dict[str, Any]:
    """The per-op profile for one block length T (see :func:`profile`)."""
    from mlx_lm.models.cache import ArraysCache
    from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

    from hf2q.kernels.gdn import prepare_ops

    ga, sa = glayer.linear_attn, alayer.self_attn
    att = target.layers.index(alayer)
    n_lin, n_att = counts
    backend = select.backend()
    k_calls = args.profile_calls
    H = target.hidden_size
    mx.random.seed(4)
    x = (mx.random.normal((1, T, H)) * 0.5).astype(dtype)
    conv0 = (mx.random.normal((1, ga.conv_kernel_size - 1, ga.conv_dim)) * 0.5).astype(dtype)
    st0 = mx.random.normal((1, ga.num_v_heads, ga.head_v_dim, ga.head_k_dim)) * 0.05
    qkv = ga.in_proj_qkv(x)
    a, b = ga.in_proj_a(x), ga.in_proj_b(x)
    z = ga.in_proj_z(x).reshape(1, T, ga.num_v_heads, ga.head_v_dim)
    q, kk, v, g, beta = prepare_ops(ga, mx.concatenate([conv0, qkv], axis=1), a, b)
    y, _ = gated_delta_steps_ops(q, kk, v, g, beta, st0, record="final")
    kv_cache = fill_target_cache(target, args.context, dtype)[att]
    kv_off = kv_cache.offset
    mx.eval(x, conv0, st0, qkv, a, b, z, q, kk, v, g, beta, y, kv_cache.state)

    def conv_silu():
        return nn.silu(ga.conv1d(mx.concatenate([conv0, qkv], axis=1)))

    def qk_norm():
        return normalize_qk(q, kk, inv_scale=ga.head_k_dim**-0.5, eps=1e-6)

    def gdn_layer_stock():
        c = ArraysCache(size=2)
        c[0], c[1] = conv0, st0
        return glayer(x, None, c)

    def attn_layer():
        kv_cache.offset = kv_off
        return alayer(x, mask="causal" if T > 1 else None, cache=kv_cache)

    def attn_sdpa_part():
        kv_cache.offset = kv_off
        return sa(alayer.input_layernorm(x), mask="causal" if T > 1 else None, cache=kv_cache)

    pieces: dict[str, tuple[str, Callable[[], Any]]] = {
        "gdn/norms(2)": (
            "gdn",
            lambda: (glayer.input_layernorm(x), glayer.post_attention_layernorm(x)),
        ),
        "gdn/in_proj(qkv,z,a,b)": (
            "gdn",
            lambda: (ga.in_proj_qkv(x), ga.in_proj_z(x), ga.in_proj_a(x), ga.in_proj_b(x)),
        ),
        "gdn/conv+silu": ("gdn", conv_silu),
        "gdn/qk_norm": ("gdn", qk_norm),
        "gdn/gates": ("gdn", lambda: (compute_g(ga.A_log, a, ga.dt_bias), mx.sigmoid(b))),
        "gdn/recurrence:mlx-lm-ops-loop": (
            "gdn-alt",
            lambda: gated_delta_ops(q, kk, v, g, beta, st0),
        ),
        "gdn/recurrence:ops-states": (
            "gdn",
            lambda: gated_delta_steps_ops(q, kk, v, g, beta, st0, record="states"),
        ),
        "gdn/recurrence:ops-final": (
            "gdn-alt",
            lambda: gated_delta_steps_ops(q, kk, v, g, beta, st0, record="final"),
        ),
        "gdn/recurrence:mx.fast.gated_delta_update": (
            "gdn-alt",
            lambda: mx.fast.gated_delta_update(q, kk, v, g, beta, st0),
        ),
        "gdn/gated_norm": ("gdn", lambda: ga.norm(y, z)),
        "gdn/out_proj": ("gdn", lambda: ga.out_proj(y.reshape(1, T, -1))),
        "gdn/mlp": ("gdn", lambda: glayer.mlp(x)),
        "gdn/residual_adds(2)": ("gdn", lambda: (x + x) + x),
        "gdn/whole_layer:mlx-lm": ("total", gdn_layer_stock),
        "attn/whole_layer:mlx-lm(ctx)": ("total", attn_layer),
        "attn/attention(norm,qkv,rope,cache,sdpa,o_proj)": ("attn", attn_sdpa_part),
        "attn/mlp+norm+adds": (
            "attn",
            lambda: x + alayer.mlp(alayer.post_attention_layernorm(x + x)),
        ),
        "head/norm+lm_head": ("head", lambda: target.logits(x)),
    }
    if backend == "cuda":
        from hf2q.kernels.cuda_gated_delta import gated_delta_steps_cuda, gdn_fused_cuda

        fused_args = (conv0, qkv, ga.conv1d.weight, a, b, ga.A_log, ga.dt_bias, st0)
        fused_kw = dict(
            num_k_heads=ga.num_k_heads,
            key_dim=ga.head_k_dim,
            num_v_heads=ga.num_v_heads,
            value_dim=ga.head_v_dim,
        )
        pieces.update(
            {
                "gdn/recurrence:cuda-states": (
                    "gdn-alt",
                    lambda: gated_delta_steps_cuda(q, kk, v, g, beta, st0, record="states"),
                ),
                "gdn/recurrence:cuda-final": (
                    "gdn-alt",
                    lambda: gated_delta_steps_cuda(q, kk, v, g, beta, st0, record="final"),
                ),
                "gdn/fused(conv..recurrence):cuda-states": (
                    "gdn-alt",
                    lambda: gdn_fused_cuda(*fused_args, record="states", **fused_kw),
                ),
                "gdn/fused(conv..recurrence):cuda-final": (
                    "gdn-alt",
                    lambda: gdn_fused_cuda(*fused_args, record="final", **fused_kw),
                ),
                "gdn/fused replay n=8:cuda": (
                    "gdn-alt",
                    lambda: gdn_fused_cuda(
                        *fused_args, record="final", steps=min(8, T), **fused_kw
                    ),
                ),
                "gdn/whole_layer:fused-states": (
                    "total",
                    lambda: gdn_decoder_layer(glayer, x, conv0, st0, impl="cuda", record="states")[
                        0
                    ],
                ),
                "gdn/whole_layer:fused-final-compiled": (
                    "total",
                    lambda c=compile_gdn_decoder_layer(glayer, impl="cuda", record="final"): c(
                        x, conv0, st0
                    )[0],
                ),
            }
        )
        pieces["gdn/whole_layer:fused-final-compiled+proj"] = (
            "total",
            lambda c=compile_gdn_decoder_layer(glayer, impl="cuda", record="final", fused=fuse_projections(glayer)): (
                c(x, conv0, st0)[0]
            ),
        )
    else:
        pieces["gdn/whole_layer:ops-final-compiled"] = (
            "total",
            lambda c=compile_gdn_decoder_layer(glayer, impl="ops", record="final"): c(
                x, conv0, st0
            )[0],
        )
    attn_c = compile_attention_layer(alayer, fuse_proj=True)

    def attn_layer_compiled():
        kv_cache.offset = kv_off
        return attn_c(x, "causal" if T > 1 else None, kv_cache)

    pieces["attn/whole_layer:compiled+proj(ctx)"] = ("total", attn_layer_compiled)
    table: dict[str, Any] = {}
    for name, (kind, fn) in pieces.items():
        if budget.left() <= 0:
            table[name] = {"skipped": "time budget spent"}
            continue

        def run(fn=fn):
            mx.eval([fn() for _ in range(k_calls)])

        try:
            r = measure(run, reps=max(3, args.reps // 2), warmup=2)
            per_call = r["median_ms"] / k_calls
            count = {
                "gdn": n_lin,
                "gdn-alt": n_lin,
                "attn": n_att,
                "head": 1,
                "total": n_lin if name.startswith("gdn") else n_att,
            }[kind]
            table[name] = {
                "per_call_ms": per_call,
                "layers": count,
                "x_layers_ms": per_call * count,
                "kind": kind,
            }
            log(
                f"  profile T={T} {name}: {per_call * 1e3:.1f} us x {count} = {per_call * count:.3f} ms"
            )
        except Exception as exc:
            table[name] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  profile T={T} {name}: ERROR {type(exc).__name__}: {str(exc)[:1500]}")
    main = sum(v["x_layers_ms"] for v in table.values() if v.get("kind") in ("gdn", "attn", "head"))
    return {"pieces": table, "sum_of_main_pieces_ms": main}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="small shapes (CPU)")
    p.add_argument("--dtypes", default=None, help="comma list of bf16, 4bit, float32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--keep", type=int, default=8, help="tokens kept by the timed rollback")
    p.add_argument("--new-context", type=int, default=8, help="new drafter context rows per round")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--paths", default="", help="comma list of paths to run (default: all)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--profile-calls", type=int, default=8)
    p.add_argument("--bandwidth-mb", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new parts after this")
    p.add_argument("--out", default=None, help="write the JSON results here")
    args = p.parse_args(argv)
    args.paths = [s for s in args.paths.split(",") if s]
    backend = select.backend()
    shape = "small" if args.small else "4b"
    dtypes = (args.dtypes or ("bf16,4bit" if backend != "cpu" else "float32")).split(",")
    args.reps = args.reps or (15 if backend != "cpu" else 5)
    budget = Budget(args.budget_s)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    from hf2q import platform as plat

    results: dict[str, Any] = {
        "command": " ".join(
            [Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])
        ),
        "shape": shape,
        "shapes": SHAPES[shape],
        "platform": plat.describe(),
        "device_info": {k: str(v) for k, v in mx.device_info().items()},
        "context": args.context,
        "block": args.block,
        "runs": {},
    }
    results["loadavg_start"] = os.getloadavg()
    log(f"verify_cost: backend={backend} shape={shape} dtypes={dtypes} reps={args.reps}")
    bw_bytes = (args.bandwidth_mb or (2048 if backend != "cpu" else 256)) * 2**20
    results["copy_bandwidth"] = (
        guarded({}, "bw", lambda: copy_bandwidth(bw_bytes, 10), budget, log) or {}
    )
    log(f"copy bandwidth: {results['copy_bandwidth'].get('GB_per_s', float('nan')):.1f} GB/s")
    for dname in dtypes:
        if budget.left() <= 0:
            results["runs"][dname] = {"skipped": "time budget spent"}
            continue
        log(f"== {dname}")
        run: dict[str, Any] = {}
        results["runs"][dname] = run
        try:
            t0 = time.perf_counter()
            target = build_target(shape, dname)
            act_dtype = mx.float32 if dname == "float32" else mx.bfloat16
            drafter = build_drafter(shape, target, act_dtype)
            run["build_s"] = time.perf_counter() - t0
            first_lin = target.layers[target.linear_layers[0]].linear_attn
            run["kernels"] = select.describe(first_lin)
            wb = weight_bytes_per_token(target)
            sb = state_bytes_per_token(target, args.context, 2 if act_dtype == mx.bfloat16 else 4)
            bw = results["copy_bandwidth"].get("GB_per_s")
            run["bytes_per_token"] = {"weights": wb, "caches": sb}
            if bw:
                run["bandwidth_floor_ms"] = (wb + sb) / (bw * 1e9) * 1e3
                log(
                    f"bandwidth floor: {run['bandwidth_floor_ms']:.3f} ms ({(wb + sb) / 1e9:.2f} GB/token)"
                )
        except Exception as exc:
            run["error"] = f"{type(exc).__name__}: {exc}"
            run["traceback"] = traceback.format_exc()
            log(f"build failed: {exc}")
            continue
        timings: dict[str, Any] = {}
        run["timings"] = timings
        bench_paths(
            target, drafter, args, act_dtype, timings, budget, log, quick=dname != dtypes[0]
        )
        run["summary"] = summarise(timings, args.block)
        floor = run.get("bandwidth_floor_ms")
        if floor:
            for row in run["summary"].values():
                if row.get("decode1_ms"):
                    row["decode1_over_floor"] = row["decode1_ms"] / floor
        if not args.no_profile:
            run["profile"] = guarded(
                {},
                "profile",
                lambda t=target, d=act_dtype: profile(t, args, d, budget, log),
                budget,
                log,
            )
        target = drafter = None  # free the model before the next dtype
        mx.clear_cache()
        if args.out:  # write as we go: a later crash keeps what was measured
            Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    results["loadavg_end"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print_table(results, args.block)
    return 0


def print_table(results: dict, T: int) -> None:
    print(
        f"\ncopy bandwidth {results.get('copy_bandwidth', {}).get('GB_per_s', float('nan')):.1f} GB/s"
    )
    for dname, run in results["runs"].items():
        summary = run.get("summary") or {}
        print(f"\n[{dname}] floor {run.get('bandwidth_floor_ms', float('nan')):.3f} ms/token")
        print(
            f"{'path':28s} {'decode1':>9s} {'verify' + str(T):>9s} {'ratio':>6s} {'rollback':>9s} {'draft':>8s} {'E(stock)':>9s} {'E(own)':>7s} {'dec/floor':>9s}"
        )

        def f(x, w=9, d=3):
            return f"{x:{w}.{d}f}" if isinstance(x, (int, float)) else f"{'-':>{w}s}"

        for name, row in summary.items():
            print(
                f"{name:28s} {f(row.get('decode1_ms'))} {f(row.get(f'verify{T}_ms'))} "
                f"{f(row.get(f'verify{T}_over_decode1'), 6, 2)} {f(row.get('rollback_ms'))} "
                f"{f(row.get(f'draft{T}_ms'), 8)} {f(row.get('E_vs_stock_decode'), 9, 2)} "
                f"{f(row.get('E_vs_own_decode'), 7, 2)} {f(row.get('decode1_over_floor'), 9, 2)}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
