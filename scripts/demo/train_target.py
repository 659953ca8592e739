"""Train the demo target from scratch: a tiny Qwen3.5 (Gated DeltaNet + full attention) on stdlib code.

What it does: builds a ``Qwen3_5ForCausalLM`` with transformers' own classes (the genuine Hugging
Face layout, ``model_type: qwen3_5_text``; 8 layers, every 4th one full attention, hidden 256,
tied embeddings) and trains it with torch on the token streams ``prepare_data.py`` wrote: AdamW,
linear warmup then cosine decay, gradient clipping, bf16 autocast on CUDA (float32 on CPU),
fixed seeds. Data order is epoch-based: every epoch cuts the training stream into windows of
``seq_len + 1`` tokens at a random offset and visits them in a random order. The number of steps is
either given (``--steps``) or chosen to fill ``--minutes`` of training after timing a few
calibration steps (capped at ``--max-epochs``). At the end it measures held-out perplexity on every
window of the held-out stream, saves the model in bfloat16 with ``save_pretrained`` (shards of at
most 12 MB), copies the tokenizer and generation config next to it, and writes ``train_log.json``
(configuration, seed, steps, tokens, wall times, the loss curve, held-out loss along the way and
the final held-out perplexity and bits per byte).

What it does not do: tokenize (``prepare_data.py``), convert to MLX (``hf2q convert``) or train
the drafter (``hf2q train-draft``).

Full scale on an NVIDIA GPU (about 6 minutes wall with start-up, evaluation and saving)::

    python3 scripts/demo/train_target.py --data runs/demo/data --out $OUT/target \
        --device cuda --minutes 5

Smoke scale on the CPU (a minute)::

    python scripts/demo/train_target.py --data runs/demo/data --out runs/demo/smoke \
        --device cpu --steps 20 --batch-size 4 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for hub kernels or files
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: The demo target's shape (Qwen3.5's layout scaled down; head sizes as in the released models'
#: ratios). About 9M parameters, 18 MB in bfloat16.
DEMO_SHAPE: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("runs/demo/data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time budget")
    ap.add_argument(
        "--steps", type=int, default=None, help="fixed step count (overrides --minutes)"
    )
    ap.add_argument("--max-epochs", type=float, default=10.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup-frac", type=float, default=0.04)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--evals", type=int, default=10, help="held-out checks during training")
    ap.add_argument("--calib-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    ap.add_argument(
        "--shape",
        default="demo",
        help="'demo' or a JSON object of config overrides (e.g. for a tiny smoke model)",
    )
    return ap.parse_args(argv)


class Windows:
    """Epoch-based windows of ``seq_len + 1`` tokens over one token stream, seeded."""

    def __init__(self, stream: Any, seq_len: int, batch: int, seed: int) -> None:
        import torch

        self.stream, self.seq, self.batch = stream, seq_len, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self._order: Any = None
        self._pos = 0
        self._offset = 0

    @property
    def per_epoch(self) -> int:
        return (self.stream.numel() - 1) // self.seq - 1

    def _new_epoch(self) -> None:
        import torch

        self._offset = int(torch.randint(0, self.seq, (1,), generator=self.gen))
        self._order = torch.randperm(self.per_epoch, generator=self.gen)
        self._pos = 0

    def next(self) -> Any:
        """A (batch, seq_len + 1) int64 tensor on the stream's device."""
        import torch

        if self._order is None or self._pos + self.batch > self._order.numel():
            if self._order is not None:
                self.epoch += 1
            self._new_epoch()
        idx = self._order[self._pos : self._pos + self.batch]
        self._pos += self.batch
        starts = (self._offset + idx * self.seq).to(self.stream.device)
        rows = starts[:, None] + torch.arange(self.seq + 1, device=self.stream.device)[None, :]
        return self.stream[rows]


def build_model(vocab_rows: int, shape: dict[str, Any], special: dict[str, int]) -> Any:
    import transformers as tf

    shape = dict(shape)
    # Qwen3.5's schedule written out (every 4th layer full attention), so the config does not
    # depend on how a transformers release derives it.
    layers = int(shape["num_hidden_layers"])
    shape.setdefault(
        "layer_types",
        ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )
    cfg = tf.Qwen3_5TextConfig(
        vocab_size=vocab_rows,
        bos_token_id=None,
        eos_token_id=special["<|endoftext|>"],
        pad_token_id=special["<|endoftext|>"],
        **shape,
    )
    return tf.Qwen3_5ForCausalLM(cfg)


def lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    warm = max(1, round(args.warmup_frac * total))
    if step < warm:
        return args.lr * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, total - warm))
    floor = args.lr * args.min_lr_frac
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * p))


def heldout_nll(
    model: Any, stream: Any, seq_len: int, batch: int, ctx: Any, limit: int | None
) -> tuple[float, int]:
    """Mean next-token NLL (nats) over non-overlapping windows of the held-out stream, and the count."""
    import torch
    import torch.nn.functional as F

    n = (stream.numel() - 1) // seq_len
    if limit is not None:
        n = min(n, limit)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            starts = torch.arange(i, min(n, i + batch), device=stream.device) * seq_len
            rows = starts[:, None] + torch.arange(seq_len + 1, device=stream.device)[None, :]
            x = stream[rows]
            with ctx():
                logits = model(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += x[:, 1:].numel()
    model.train()
    return total / max(1, count), count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    import contextlib

    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    data: Path = args.data
    manifest = json.loads((data / "manifest.json").read_text())
    special = manifest["tokenizer"]["special_ids"]
    rows = int(manifest["tokenizer"]["embedding_rows"])
    shape = dict(DEMO_SHAPE)
    if args.shape != "demo":
        shape.update(json.loads(args.shape))

    train = torch.from_numpy(np.load(data / "train.npy").astype(np.int64)).to(device)
    held = torch.from_numpy(np.load(data / "heldout.npy").astype(np.int64)).to(device)
    windows = Windows(train, args.seq_len, args.batch_size, args.seed)

    model = build_model(rows, shape, special).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # Matrices decay; norms, gates' scalars (A_log, dt_bias), conv kernels and the (tied)
        # embedding do not.
        (decay if p.ndim == 2 and "embed_tokens" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        **({"fused": True} if device == "cuda" else {}),
    )
    if device == "cuda":

        def autocast() -> Any:
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    tokens_per_step = args.batch_size * args.seq_len
    max_steps_by_epochs = int(args.max_epochs * windows.per_epoch / args.batch_size)
    log: dict[str, Any] = {
        "script": "scripts/demo/train_target.py",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "data_manifest_python": manifest["python_version"],
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "train_tokens": int(train.numel()),
        "heldout_tokens": int(held.numel()),
        "parameters": int(n_params),
        "shape": shape,
        "losses": [],
        "heldout_curve": [],
    }
    setup_s = time.time() - t_start

    total = args.steps
    step = 0
    t_train = time.time()
    eval_s = 0.0
    losses: list[tuple[int, float]] = []

    def one_step(total_steps: int) -> float:
        lr = lr_at(step, total_steps, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x = windows.next()
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        return loss.detach()

    if total is None:
        # Calibrate: time a few steps (the first ones pay for kernel set-up), then fix the step
        # count that fills the budget. The schedule during calibration assumes a long run.
        guess = max_steps_by_epochs
        for _ in range(args.calib_steps):
            loss = one_step(guess)
            step += 1
        sync()
        t_cal = time.time()
        for _ in range(args.calib_steps):
            loss = one_step(guess)
            step += 1
        sync()
        per_step = (time.time() - t_cal) / args.calib_steps
        remaining = args.minutes * 60 - (time.time() - t_train)
        total = step + int(remaining / per_step * 0.97)  # leave room for the held-out checks
        total = max(step + 1, min(total, max_steps_by_epochs))
        log["calibration_s_per_step"] = per_step
        losses.append((step, float(loss)))
    log["planned_steps"] = total
    eval_at = (
        {round(total * (i + 1) / args.evals) for i in range(args.evals)} if args.evals else set()
    )
    deadline = t_train + args.minutes * 60 * 1.05 if args.steps is None else math.inf
    t_log = time.time()
    while step < total:
        loss = one_step(total)
        step += 1
        if step % args.log_every == 0 or step == total:
            value = float(loss)
            losses.append((step, value))
            now = time.time()
            tok_s = args.log_every * tokens_per_step / max(1e-9, now - t_log)
            t_log = now
            print(
                f"step {step}/{total} loss {value:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"epoch {windows.epoch} {tok_s:,.0f} tok/s {now - t_train:.0f}s",
                flush=True,
            )
        if step in eval_at and step != total:
            t_e = time.time()
            nll, _ = heldout_nll(model, held, args.seq_len, args.batch_size, autocast, limit=64)
            eval_s += time.time() - t_e
            log["heldout_curve"].append({"step": step, "loss": nll})
            print(f"  held-out loss {nll:.4f} (64 windows)", flush=True)
        if time.time() > deadline:
            print(f"time budget reached at step {step}; stopping", flush=True)
            break
    sync()
    train_s = time.time() - t_train

    t_e = time.time()
    nll, counted = heldout_nll(model, held, args.seq_len, args.batch_size, autocast, limit=None)
    final_eval_s = time.time() - t_e
    held_bytes = manifest["splits"]["heldout"]["bytes"]
    held_tokens = manifest["splits"]["heldout"]["tokens"]
    bpb = nll / math.log(2) * held_tokens / held_bytes
    print(
        f"held-out: loss {nll:.4f}, perplexity {math.exp(nll):.3f}, {bpb:.3f} bits/byte", flush=True
    )

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.to(torch.bfloat16).save_pretrained(str(tmp), max_shard_size="12MB")
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, tmp / f.name)
    log.update(
        steps=step,
        tokens=step * tokens_per_step,
        epochs=step * tokens_per_step / max(1, train.numel()),
        losses=losses,
        setup_s=round(setup_s, 1),
        train_s=round(train_s, 1),
        eval_during_training_s=round(eval_s, 1),
        final_eval_s=round(final_eval_s, 1),
        heldout={
            "tokens_scored": counted,
            "loss": nll,
            "perplexity": math.exp(nll),
            "bits_per_byte": bpb,
            "windows_of": args.seq_len,
        },
        wall_s=round(time.time() - t_start, 1),
    )
    (tmp / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    tmp.rename(out)
    print(
        f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) after "
        f"{step} steps, {step * tokens_per_step:,} tokens, {log['wall_s']} s wall",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
