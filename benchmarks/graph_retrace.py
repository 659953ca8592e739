"""Host time of a compiled graph's new trace against its replay (the DFlash verify graph).

Why: ``hf2q.kernels.forward``'s graphs are traced per input shape, and a KV buffer's growth
changes a shape, so the whole model is traced again (the layer path's compiled pieces never see
the buffer). That Python and compile work is the same on every backend, so this measures it
anywhere: it verifies blocks through ``CompiledVerify`` (forced, the runners made the path as on
CUDA) from a prompt just below a buffer size, times each call's graph building (not its
evaluation), and reports the calls that found a new buffer size (a new trace) apart from the
replays. Buffers grow by ``graph_capacity`` (at least 1024 positions or half the buffer).

Usage (a random-weight pair of benchmarks/slots_synthetic.py's shapes):
    python benchmarks/graph_retrace.py --synthetic small --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", choices=("small", "4b"), default="small")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=40, help="verify blocks, all kept")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from slots_synthetic import synthetic_pair

    from hf2q.kernels import layers, select
    from hf2q.runtime import verify
    from hf2q.runtime.cache import make_target_cache
    from hf2q.runtime.dflash import prefill

    layers.decode_runners_active = verify.decode_runners_active = lambda: True  # this process
    os.environ[select.COMPILE_VERIFY_ENV] = "1"
    pair = synthetic_pair(args.synthetic)
    target, ids = pair.target, pair.drafter.config.target_layer_ids
    vocab = target.args.vocab_size
    cache = make_target_cache(target.model)
    prefill(target, [(7 * i) % vocab for i in range(args.prompt_tokens)], cache)
    mx.eval(cache.state)
    whole = verify.whole_verify(target, cache, args.block, ids)
    seen: set[int] = set()
    trace_ms, replay_ms, sizes = [], [], []
    for r in range(args.rounds):
        size = next(c.keys.shape[2] for c in cache if hasattr(c, "keys"))
        block = mx.array([[(r * 31 + j) % vocab for j in range(args.block)]], dtype=mx.int32)
        tic = time.perf_counter()
        out = verify.verify_forward(target, block, cache, capture=ids, whole=whole)
        ms = (time.perf_counter() - tic) * 1e3
        mx.eval(out)
        cache.rollback(args.block)
        mx.eval(cache.state)
        after = next(c.keys.shape[2] for c in cache if hasattr(c, "keys"))
        (replay_ms if after in seen else trace_ms).append(ms)
        seen.add(after)
        sizes.append([size, after])
    report = {
        "model": f"synthetic {args.synthetic}",
        "layers": target.num_layers,
        "device": str(mx.default_device()),
        "rounds": args.rounds,
        "positions": [args.prompt_tokens, cache.offset],
        "buffer_sizes": sorted(seen),
        "trace_ms": [round(t, 2) for t in trace_ms],
        "replay_ms_median": round(statistics.median(replay_ms), 3) if replay_ms else None,
    }
    text = json.dumps(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
