"""``hf2q bench``'s measurement on a random-weight Qwen3.5-4B-shaped pair (no checkpoint needed).

What it does: build a Qwen3.5 target of Qwen3.5-4B's shape through mlx-lm's own ``qwen3_5``
classes (random initialisation, bf16: hidden 2560, 32 layers with full attention every 4th,
16 query / 4 key-value heads of 256, MLP 9216, Gated-DeltaNet 16 key / 32 value heads of 128,
vocab 248320, tied embeddings) and a random DFlash drafter of z-lab's Qwen3.5-4B drafter shape
(5 layers, 32 / 8 heads of 128, MLP 9728, target layers [1, 8, 15, 22, 29], block 16), then run
``hf2q.runtime.bench.run_bench`` with the random workload (EOS ignored) and write the same JSON
report as ``hf2q bench --json``.

What it measures: costs. A random drafter is almost never accepted (tau about 1), so the figures
are round times, their draft / verify / rollback split, how aggregate tok/s scales with the slot
count, and round efficiency E = t(plain step) / t(DFlash round) at each slot count; the DFlash
speedup for a drafter with acceptance length tau is tau x E (tau: ``hf2q bench`` on a real pair).

Usage (GPU: see docs/BENCHMARKS.md for the exact H200 command)::

    python benchmarks/slots_synthetic.py --slots 1,2,4,8 --out runs/slots-4b.json
    python benchmarks/slots_synthetic.py --shape small --slots 1,2 --gen-tokens 8 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN35_4B_DRAFTER, QWEN35_4B_TARGET  # noqa: E402

SHAPES = {
    # Qwen3.5-4B (its config.json) and z-lab's Qwen3.5-4B-DFlash drafter.
    "4b": dict(target=dict(QWEN35_4B_TARGET), drafter=dict(QWEN35_4B_DRAFTER)),
    # The same structure shrunk for a CPU check of this script.
    "small": dict(
        target=dict(
            hidden_size=128,
            num_hidden_layers=8,
            full_attention_interval=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            vocab_size=4096,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters={
                "type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
        ),
        drafter=dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            target_layer_ids=[1, 4, 6],
            mask_token_id=4000,
        ),
    ),
}


def build_pair(shape: str, dtype: str, seed: int, target_bits: int = 0, draft_bits: int = 0):
    """(TargetModel, bound DFlashDraftModel) with random weights of ``SHAPES[shape]``;
    ``target_bits`` / ``draft_bits`` 4 or 8: that model's layers quantized as ``nn.quantize``
    does (affine, groups of 64; the target's tied embedding, and so the head the drafter shares,
    with them), 0: unquantized."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen3_5

    from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel
    from hf2q.runtime.target import TargetModel

    mx.random.seed(seed)
    spec = SHAPES[shape]
    text = dict(spec["target"], model_type="qwen3_5_text")
    model = qwen3_5.Model(
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text})
    )
    dt = getattr(mx, dtype)
    model.set_dtype(dt)
    for layer in model.language_model.model.layers:  # A_log stays float32, as mlx-lm loads it
        if layer.is_linear:
            layer.linear_attn.A_log = layer.linear_attn.A_log.astype(mx.float32)
    if target_bits:
        nn.quantize(model, group_size=64, bits=target_bits)
    model.eval()
    mx.eval(model.parameters())
    target = TargetModel(model)
    d = spec["drafter"]
    cfg = DFlashConfig(
        hidden_size=text["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"],
        intermediate_size=d["intermediate_size"],
        vocab_size=text["vocab_size"],
        num_target_layers=text["num_hidden_layers"],
        target_layer_ids=d["target_layer_ids"],
        mask_token_id=d["mask_token_id"],
        block_size=16,
        rope_theta=10000000.0,
    )
    drafter = DFlashDraftModel(cfg)
    drafter.set_dtype(dt)
    if draft_bits:
        nn.quantize(drafter, group_size=64, bits=draft_bits)
    drafter.eval()
    mx.eval(drafter.parameters())
    drafter.bind(target.embed, target.head)
    return target, drafter


def quantized_drafter(drafter, bits: int):
    """A copy of ``drafter`` (the same weights; bound to the same embedding and head where it is
    bound) with its layers quantized to ``bits`` as :func:`build_pair`'s ``draft_bits`` does
    (affine, groups of 64)."""
    import mlx.core as mx
    import mlx.nn as nn

    from hf2q.runtime.drafter import DFlashDraftModel

    copy = DFlashDraftModel(drafter.config)
    copy.update(drafter.parameters())
    nn.quantize(copy, group_size=64, bits=bits)
    copy.eval()
    mx.eval(copy.parameters())
    return copy.bind(drafter._embed, drafter._head) if drafter.is_bound else copy


def synthetic_pair(shape: str, dtype: str = "bfloat16", seed: int = 0, target_bits: int = 0):
    """``build_pair`` as a ``hf2q.runtime.pair.Pair`` (no tokenizer: use random prompts), for
    the profiling scripts' ``--synthetic SHAPE``."""
    from hf2q.runtime.pair import Pair

    target, drafter = build_pair(shape, dtype, seed, target_bits)
    return Pair(target, drafter, None, f"synthetic {shape}", f"synthetic {shape}", False)


def add_pair_arguments(ap) -> None:
    """The profiling scripts' choice of pair: ``-m/-d`` (default: the embedded demo pair) or
    ``--synthetic SHAPE`` with ``--prompt-tokens`` random prompt ids, ``--dtype``, and the draft
    head as ``hf2q generate`` takes it (``--draft-head-bits``, ``--draft-vocab``)."""
    ap.add_argument("-m", "--model", default=None, help="target (default: the embedded demo pair)")
    ap.add_argument("-d", "--draft", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--synthetic",
        choices=sorted(SHAPES),
        default=None,
        help="profile a random-weight pair of this shape (benchmarks/slots_synthetic.py) instead",
    )
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="with --synthetic")
    ap.add_argument("--draft-head-bits", type=int, default=0, choices=[0, 4, 8])
    ap.add_argument("--draft-vocab", type=int, default=0)


def pair_and_prompts(args, n: int):
    """``(pair, dtype, prompts)`` for :func:`add_pair_arguments`' options: ``n`` built-in prompts
    of a loaded pair, or ``n`` random ones of ``--prompt-tokens`` ids for ``--synthetic``."""
    from hf2q.runtime.bench import BenchConfig, make_prompts
    from hf2q.runtime.pair import apply_dtype, load_pair

    if args.synthetic:
        pair = synthetic_pair(args.synthetic)
        dtype = "bfloat16"
        config = BenchConfig(workload="random", prompt_tokens=args.prompt_tokens)
        vocab = pair.target.args.vocab_size
    else:
        pair = load_pair(args.model, args.draft)
        dtype = apply_dtype(pair.target, pair.drafter, args.dtype)
        config, vocab = BenchConfig(), None
    prompts = make_prompts(config, n, tokenizer=pair.tokenizer, vocab_size=vocab)
    bits, words = args.draft_head_bits, args.draft_vocab
    if bits or words:
        pair.drafter.bind(pair.target.embed, pair.target.draft_head(bits, words))
    return pair, dtype, prompts


def _bits(bits: int) -> str:
    return f", {bits}-bit" if bits else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--target-bits", type=int, default=0, choices=[0, 4, 8])
    ap.add_argument("--draft-bits", type=int, default=0, choices=[0, 4, 8])
    ap.add_argument(
        "--draft-head-bits",
        type=int,
        default=0,
        choices=[0, 4, 8],
        help="drafts read a quantized copy of the target's head (hf2q generate's option)",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="drafts propose from this many of the lowest token ids (hf2q generate's option)",
    )
    ap.add_argument("--slots", default="1,2,4,8")
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--idle", default="compact", choices=["compact", "keep"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lookup",
        action="store_true",
        help="let DFlash rounds draft by n-gram lookup (off: every round runs the drafter, so the"
        " round times are the drafter's costs; random weights often loop, which lookup would catch)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import mlx.core as mx

    from hf2q.platform import describe
    from hf2q.runtime.bench import BenchConfig, parse_slots, run_bench

    config = BenchConfig(
        slots=parse_slots(args.slots),
        gen_tokens=args.gen_tokens,
        prompt_tokens=args.prompt_tokens,
        trials=args.trials,
        warmup=args.warmup,
        block_size=args.block_size,
        workload="random",
        baseline=not args.no_baseline,
        seed=args.seed,
        idle=args.idle,
        lookup=args.lookup,
    ).validate()
    tic = time.perf_counter()
    target, drafter = build_pair(
        args.shape, args.dtype, args.seed, args.target_bits, args.draft_bits
    )
    drafter.bind(target.embed, target.draft_head(args.draft_head_bits, args.draft_vocab))
    built = time.perf_counter() - tic

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - tic:7.1f}s] {text}", file=sys.stderr, flush=True)

    report = run_bench(target, drafter, config, progress=progress)
    report = {
        "model": f"synthetic Qwen3.5-{args.shape} (random {args.dtype} weights{_bits(args.target_bits)})",
        "draft": f"synthetic DFlash drafter ({args.shape} shape, random weights{_bits(args.draft_bits)})",
        "draft_head_bits": args.draft_head_bits or None,
        "draft_vocab": args.draft_vocab or None,
        **report,
        "platform": describe(),
        "build_s": round(built, 1),
        "wall_s": round(time.perf_counter() - tic, 1),
        "peak_memory_gb_process": round(mx.get_peak_memory() / 1e9, 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
