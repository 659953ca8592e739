"""The ``hf2q train-draft`` loop: a DFlash drafter trained against a frozen target, on MLX.

What it does: load the target (any checkpoint hf2q loads, quantized or not) and freeze it; build
a drafter whose hidden size, vocabulary and layer ids fit it (``fc``, ``hidden_norm``, the layer
stack and ``norm`` are trained; the target's embedding and lm_head are used frozen); prepare the
data (``hf2q.train.data``); then, step by step, compute the target's features of
``target_layer_ids`` on the fly, sample anchors, run all blocks through the drafter at once and
minimise the decayed block loss (``hf2q.train.objective``) with AdamW (linear warmup, cosine
decay, gradient clipping). Every ``eval_every`` steps and at the end it measures tau with the real
DFlash decoding loop on held-out prompts (``hf2q.train.evaluate``). It writes resumable
checkpoints into ``OUT/checkpoint/`` and, at the end, the drafter in z-lab's format
(``OUT/config.json`` + ``OUT/model.safetensors``) and ``OUT/train_log.json``.

:func:`train_draft` is a generator of typed events (stages, steps, evaluations, the end), so the
CLI renders progress and the library never prints.

What it does not do: decode (``hf2q.runtime.dflash``), render anything, or touch the target's
weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hf2q.errors import DataError, DrafterError, ModelError, OutputError, UsageError
from hf2q.runtime.pair import DTYPE_CHOICES

CHECKPOINT_DIR = "checkpoint"
LOG_FILE = "train_log.json"
ADAM_BETAS = (0.9, 0.95)
MIN_LR_FRACTION = 0.1  # cosine decays to this share of the peak learning rate


@dataclass
class TrainDraftConfig:
    """Everything ``hf2q train-draft`` takes; see the CLI help for each option."""

    target: str
    data: list[str]
    out: Path
    layers: int | None = None
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    anchors_per_seq: int = 64
    gamma: float | None = None
    seq_len: int = 512
    batch_size: int = 8
    steps: int | None = None
    epochs: float | None = None
    lr: float = 6e-4
    warmup: float = 0.04
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 200
    eval_data: list[str] = field(default_factory=list)
    eval_prompts: int = 8
    eval_prompt_tokens: int = 64
    eval_max_tokens: int = 64
    max_seqs: int | None = None
    regenerate: bool = False
    regen_prompt_tokens: int = 64
    regen_temperature: float = 0.0
    regen_batch: int = 32
    init: str = "random"
    intermediate_size: int | None = None
    thinking: bool | None = None
    resume: bool = False
    force: bool = False
    checkpoint_every: int | None = None
    save_dtype: str = "bfloat16"
    log_every: int = 10
    feature_cache_gb: float = 2.0
    max_minutes: float | None = None  # stop training once this much training time has passed
    dtype: str | None = None  # the target's compute dtype, as `hf2q generate --dtype` (None: auto)


# ---- events -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """A phase began (loading, data, regeneration, training, saving)."""

    name: str
    detail: str = ""


@dataclass(frozen=True)
class Preparing:
    """Progress of a preparation stage ("regenerate": prompts, "features": sequences)."""

    name: str
    done: int
    total: int


@dataclass(frozen=True)
class StepDone:
    """Training progress, averaged over the steps since the previous event."""

    step: int  # 1-based steps done
    total: int
    loss: float
    accuracy: float  # weighted by w_k, like the loss
    train_tau: float  # 1 + mean leading correct drafts per block (teacher-forced context)
    lr: float
    blocks_per_s: float
    elapsed: float
    epoch: float


@dataclass(frozen=True)
class Evaluated:
    """tau measured with the real DFlash decoding loop."""

    step: int
    tau: float
    acceptance_rate: float
    rounds: int
    prompts: int
    generated_tokens: int
    seconds: float


@dataclass(frozen=True)
class Finished:
    out: Path
    steps: int
    log: dict[str, Any]


Event = Stage | Preparing | StepDone | Evaluated | Finished


# ---- validation ---------------------------------------------------------------------------------
def validate(cfg: TrainDraftConfig) -> None:
    """Raise :class:`UsageError` naming the bad option (before anything is loaded)."""
    if not cfg.data:
        raise UsageError("no --data given: pass text files, folders or JSONL files to train on")
    if cfg.block_size < 2:
        raise UsageError(f"--block-size must be at least 2, got {cfg.block_size}")
    if cfg.layers is not None and not 1 <= cfg.layers <= 16:
        raise UsageError(f"--layers must be between 1 and 16, got {cfg.layers}")
    if cfg.seq_len < cfg.block_size + 1:
        raise UsageError(
            f"--seq-len {cfg.seq_len} cannot hold a block of {cfg.block_size} after one context "
            f"token: use --seq-len {cfg.block_size + 1} or more"
        )
    for name, value in (
        ("--anchors-per-seq", cfg.anchors_per_seq),
        ("--batch-size", cfg.batch_size),
        ("--eval-every", cfg.eval_every),
        ("--eval-max-tokens", cfg.eval_max_tokens),
        ("--eval-prompt-tokens", cfg.eval_prompt_tokens),
        ("--regen-batch", cfg.regen_batch),
    ):
        if value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    if cfg.max_seqs is not None and cfg.max_seqs < 1:
        raise UsageError(f"--max-seqs must be at least 1, got {cfg.max_seqs}")
    if cfg.eval_prompts < 0:
        raise UsageError(
            f"--eval-prompts must be 0 (no evaluation) or more, got {cfg.eval_prompts}"
        )
    if cfg.steps is not None and cfg.epochs is not None:
        raise UsageError("pass either --steps or --epochs, not both")
    if cfg.steps is not None and cfg.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.epochs is not None and not cfg.epochs > 0:
        raise UsageError(f"--epochs must be positive, got {cfg.epochs}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        raise UsageError(f"--max-minutes must be positive, got {cfg.max_minutes}")
    if not cfg.lr > 0:
        raise UsageError(f"--lr must be positive, got {cfg.lr}")
    if not 0 <= cfg.warmup < 1:
        raise UsageError(f"--warmup is a fraction of the steps in [0, 1), got {cfg.warmup}")
    if not cfg.clip > 0:
        raise UsageError(f"--clip must be positive, got {cfg.clip}")
    if cfg.gamma is not None and not cfg.gamma > 0:
        raise UsageError(f"--gamma must be positive, got {cfg.gamma}")
    if cfg.dtype is not None and cfg.dtype not in DTYPE_CHOICES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {cfg.dtype!r}")
    if cfg.init not in ("target", "random"):
        raise UsageError(f"--init must be 'target' or 'random', got {cfg.init!r}")
    if cfg.save_dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(
            f"--save-dtype must be bfloat16, float16 or float32, got {cfg.save_dtype!r}"
        )
    if cfg.regenerate and not 1 <= cfg.regen_prompt_tokens < cfg.seq_len:
        raise UsageError(
            f"--regen-prompt-tokens must be between 1 and --seq-len - 1, got {cfg.regen_prompt_tokens}"
        )
    if cfg.resume and cfg.force:
        raise UsageError("pass either --resume (continue OUT's checkpoint) or --force (start over)")


def prepare_out(out: Path, *, resume: bool, force: bool) -> None:
    """Make sure OUT can be written and holds nothing unexpected.

    Raises:
        OutputError: OUT is not writable, is a file, or already holds a run and neither
            ``resume`` nor ``force`` says what to do with it.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} is a file: pass a folder for -o")
    has_run = out.is_dir() and any(out.iterdir())
    if has_run and not resume and not force:
        raise OutputError(
            f"{out} already exists and is not empty: pass --resume to continue its checkpoint, "
            "--force to start over, or a new -o folder"
        )
    if resume and not (out / CHECKPOINT_DIR / "state.json").is_file():
        raise OutputError(
            f"{out} has no checkpoint to resume ({CHECKPOINT_DIR}/state.json): drop --resume to start a new run"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".hf2q-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OutputError(
            f"cannot write to {out} ({exc.strerror or exc}): pass a writable -o folder"
        ) from exc
    if force and has_run:
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


# ---- the drafter --------------------------------------------------------------------------------
def first_unused_row(tokenizer: Any, rows: int) -> int | None:
    """The lowest embedding row that no token of the tokenizer maps to (None if all are used).

    "Used" means: an id in the tokenizer's vocabulary, added and special tokens included.
    """
    vocab = getattr(tokenizer, "vocab", None)
    if vocab is None:
        vocab = tokenizer._tokenizer.get_vocab()
    used = set(int(i) for i in vocab.values())
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    for tok_id in getattr(inner, "added_tokens_decoder", {}) or {}:
        used.add(int(tok_id))
    return next((r for r in range(rows) if r not in used), None)


def default_layers(num_target_layers: int) -> int:
    """About one drafter layer per six target layers (5 for a 32-layer target, as z-lab's), 1..8."""
    return max(1, min(8, round(num_target_layers / 6)))


def drafter_config(target: Any, cfg: TrainDraftConfig) -> Any:
    """The DFlash config for ``target`` from the options (sizes follow the target's attention)."""
    from hf2q.runtime.drafter import DFlashConfig, default_target_layer_ids

    args = target.args
    n = target.num_layers
    layers = cfg.layers or default_layers(n)
    ids = (
        list(cfg.target_layer_ids) if cfg.target_layer_ids else default_target_layer_ids(n, layers)
    )
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise UsageError(
            f"--target-layer-ids {bad} are outside the target's layers 0..{n - 1}: pick ids in that range"
        )
    if len(set(ids)) != len(ids):
        raise UsageError(f"--target-layer-ids {ids} repeat a layer: list each layer once")
    rows = target.vocab_size
    if cfg.mask_token_id is None:
        mask = first_unused_row(target.tokenizer, rows)
        if mask is None:
            raise UsageError(
                f"every one of the target's {rows} embedding rows is a token: pass --mask-token-id "
                "(a special token the data never contains)"
            )
    else:
        mask = int(cfg.mask_token_id)
        if not 0 <= mask < rows:
            raise UsageError(
                f"--mask-token-id {mask} is outside the target's embedding (0..{rows - 1})"
            )
    heads = int(getattr(args, "num_attention_heads", 0) or max(1, target.hidden_size // 128))
    kv = int(getattr(args, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(args, "head_dim", 0) or target.hidden_size // heads)
    inter = cfg.intermediate_size or int(
        getattr(args, "intermediate_size", 0)
        or getattr(args, "shared_expert_intermediate_size", 0)
        or 3 * target.hidden_size
    )
    rope_theta = float(
        getattr(args, "rope_theta", None)
        or (getattr(args, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    )
    return DFlashConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=rows,
        num_target_layers=n,
        target_layer_ids=ids,
        mask_token_id=mask,
        block_size=cfg.block_size,
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(getattr(args, "max_position_embeddings", 32768)),
    )


def init_from_target(drafter: Any, target: Any) -> list[str]:
    """Copy the MLP and layer norms of the target's last layers into the drafter where shapes match.

    Drafter layer i takes target layer ``N - L + i`` (the deepest layers, which already map
    features to next-token predictions). Attention stays randomly initialised (the target's
    attention has gated queries and partial rotary embeddings). Returns the names copied.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    copied: list[str] = []
    L, N = len(drafter.layers), target.num_layers
    for i, layer in enumerate(drafter.layers):
        src = target.layers[N - L + i]
        pairs = [
            ("input_layernorm", "input_layernorm"),
            ("post_attention_layernorm", "post_attention_layernorm"),
            ("mlp", "mlp"),
        ]
        for dst_name, src_name in pairs:
            src_mod, dst_mod = getattr(src, src_name, None), getattr(layer, dst_name)
            if src_mod is None:
                continue
            src_w = dict(tree_flatten(src_mod.parameters()))
            dst_w = dict(tree_flatten(dst_mod.parameters()))
            if set(src_w) != set(dst_w) or any(src_w[k].shape != dst_w[k].shape for k in dst_w):
                continue  # quantized, MoE or differently sized: keep the random init
            dst_mod.load_weights([(k, v.astype(mx.float32)) for k, v in src_w.items()])
            copied.append(f"layers.{i}.{dst_name} <- target layer {N - L + i}")
    return copied


# ---- checkpoints --------------------------------------------------------------------------------
def _save_checkpoint(folder: Path, drafter: Any, optimizer: Any, state: dict[str, Any]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "drafter.safetensors"), dict(tree_flatten(drafter.parameters())))
    opt_state = {k: v for k, v in tree_flatten(optimizer.state) if isinstance(v, mx.array)}
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    if (folder / "dataset.npz").exists():
        # The data set never changes within a run: link it into the new checkpoint (no copy of
        # tens of MB at every checkpoint); copy only where the filesystem has no hard links.
        try:
            os.link(folder / "dataset.npz", tmp / "dataset.npz")
        except OSError:
            shutil.copy(folder / "dataset.npz", tmp / "dataset.npz")
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    if old.exists():
        shutil.rmtree(old)


@contextmanager
def _wide_pass(what: str, option: str, value: int) -> Iterator[None]:
    """Run a wide batched pass; a CUDA launch failure in it becomes :func:`backend_failure`'s error."""
    try:
        yield
    except RuntimeError as exc:
        err = backend_failure(exc, what, option, value)
        if err is None:
            raise
        raise err from exc


def backend_failure(exc: RuntimeError, what: str, option: str, value: int) -> ModelError | None:
    """The error to raise for a failure of MLX's backend in a wide batched pass.

    MLX 0.32.4's CUDA backend rejects some launches of wide batches (regenerating the demo target
    failed at 128 prompts and more with ``cudaGraphAddKernelNode(...) failed: invalid argument``
    and worked at 64; ``scripts/demo/probe_batch.py`` finds the widest that works). Such a CUDA
    error becomes one line naming the option to lower; for anything else None (re-raise it).
    """
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "cuda" not in msg.lower():
        return None
    return ModelError(
        f"MLX's CUDA backend failed in {what} at {option} {value} ({msg}): pass a smaller "
        f"{option} (e.g. {max(1, value // 2)}; scripts/demo/probe_batch.py finds the widest that works)"
    )


# ---- the loop -----------------------------------------------------------------------------------
def train_draft(cfg: TrainDraftConfig) -> Iterator[Event]:
    """Train a drafter; yield :data:`Event` s; the last one is :class:`Finished`.

    Raises:
        UsageError / DataError / OutputError / ModelError / DrafterError: one line naming the fix.
    """
    from hf2q.train import data as D

    validate(cfg)
    out = Path(cfg.out)
    # Read the data first: a missing or malformed file fails before anything is written or loaded.
    text_paths = [p for p in cfg.data if not D.is_dataset(p)]
    for p in cfg.data:
        if D.is_dataset(p):
            D.require_dataset(p)
    records = D.read_records(text_paths) if text_paths else []
    eval_records = D.read_records(cfg.eval_data) if cfg.eval_data else []
    created = not out.exists()
    prepare_out(out, resume=cfg.resume, force=cfg.force)
    try:
        yield from _train(cfg, out, records, eval_records)
    except BaseException:
        # Leave nothing behind unless there is a checkpoint to resume from.
        if created and not (out / CHECKPOINT_DIR / "state.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _train(
    cfg: TrainDraftConfig, out: Path, records: list[Any], eval_records: list[Any]
) -> Iterator[Event]:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from hf2q.loading import load_model
    from hf2q.runtime.drafter import DFlashConfig, DFlashDraftModel, save_drafter
    from hf2q.runtime.pair import apply_dtype
    from hf2q.runtime.target import TargetModel
    from hf2q.train import data as D
    from hf2q.train.evaluate import inference_copy, measure_tau
    from hf2q.train.objective import (
        batch_loss,
        default_gamma,
        loss_weights,
        make_blocks,
        sample_anchors,
        valid_anchors,
    )

    t_start = time.time()
    ck_dir = out / CHECKPOINT_DIR
    yield Stage("load", f"target {cfg.target}")
    loaded = load_model(cfg.target)
    target = TargetModel(loaded.model, loaded.tokenizer)
    target.model.freeze()
    # The dtype the target computes in, as `hf2q generate --dtype` (auto: see pair.auto_dtype).
    compute_dtype = apply_dtype(target, None, cfg.dtype)
    tok = loaded.tokenizer
    eos_ids = sorted(int(i) for i in (getattr(tok, "eos_token_ids", None) or ()))

    resumed: dict[str, Any] | None = None
    if cfg.resume:
        resumed = json.loads((ck_dir / "state.json").read_text())
        dcfg = DFlashConfig.from_dict(resumed["drafter_config"], where=f"checkpoint {ck_dir}")
        try:
            dcfg.validate_for_target(
                hidden_size=target.hidden_size,
                vocab_size=target.vocab_size,
                num_layers=target.num_layers,
                where=f"the checkpoint in {ck_dir}",
            )
        except DrafterError as exc:
            reason = str(exc).rsplit(": ", 1)[0]
            raise DrafterError(
                f"{reason}: resume with the --target it was trained for, or start over with --force"
            ) from exc
    else:
        dcfg = drafter_config(target, cfg)
    B = dcfg.block_size
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(B)

    # -- data
    yield Stage("data", ", ".join(str(p) for p in cfg.data))
    chat_kwargs = {} if cfg.thinking is None else {"enable_thinking": bool(cfg.thinking)}
    if resumed is not None and (ck_dir / "dataset.npz").is_file():
        seqs, prompts = D.load_dataset(ck_dir / "dataset.npz")
    else:
        # Prepared data sets (.npz from an earlier run) are used as they are: not tokenized,
        # sampled by --max-seqs or regenerated again.
        prepared: list[Any] = []
        for p in cfg.data:
            if D.is_dataset(p):
                prepared += D.load_dataset(p, vocab_size=target.vocab_size, seq_len=cfg.seq_len)[0]
        seqs = D.tokenize(records, tok, cfg.seq_len, chat_kwargs=chat_kwargs) if records else []
        if cfg.eval_data:
            ev = D.tokenize(eval_records, tok, cfg.seq_len, chat_kwargs=chat_kwargs)
            prompts = D.eval_prompts(ev, cfg.eval_prompts, cfg.eval_prompt_tokens)
            if cfg.eval_prompts and not prompts:
                raise DataError(
                    f"no evaluation prompt in {', '.join(cfg.eval_data)}: raw texts need more than "
                    f"--eval-prompt-tokens ({cfg.eval_prompt_tokens}) tokens, chats a user turn "
                    "before an assistant turn"
                )
        elif seqs:
            seqs, prompts = D.split_eval(seqs, cfg.eval_prompts, cfg.eval_prompt_tokens, cfg.seed)
        else:
            prepared, prompts = D.split_eval(
                prepared, cfg.eval_prompts, cfg.eval_prompt_tokens, cfg.seed
            )
        if cfg.max_seqs is not None and len(seqs) > cfg.max_seqs:
            pick = np.random.default_rng([cfg.seed, 3]).choice(
                len(seqs), cfg.max_seqs, replace=False
            )
            seqs = [seqs[i] for i in sorted(pick)]
        if cfg.regenerate and seqs:
            yield Stage("regenerate", f"{len(seqs)} sequences with the target")
            regen = D.regenerate(
                target,
                seqs,
                seq_len=cfg.seq_len,
                prompt_tokens=cfg.regen_prompt_tokens,
                eos_ids=eos_ids,
                temperature=cfg.regen_temperature,
                seed=cfg.seed,
                batch_size=cfg.regen_batch,
            )
            with _wide_pass("regeneration", "--regen-batch", cfg.regen_batch):
                while True:
                    try:
                        done, of = next(regen)
                    except StopIteration as stop:
                        seqs = stop.value
                        break
                    yield Preparing("regenerate", done, of)
        seqs = D.usable(seqs + prepared, B)
    n_seq = len(seqs)
    per_epoch = D.steps_per_epoch(n_seq, cfg.batch_size)
    if resumed is not None:
        total = int(resumed["total_steps"])
    elif cfg.steps is not None:
        total = cfg.steps
    else:
        total = max(1, math.ceil((cfg.epochs or 1.0) * per_epoch))
    data_stats = {
        "sequences": n_seq,
        "tokens": int(sum(len(s) for s in seqs)),
        "response_tokens": int(sum(int(s.loss_mask.sum()) for s in seqs)),
        "eval_prompts": len(prompts),
        "regenerated": cfg.regenerate,
        "target_compute_dtype": compute_dtype,
        "steps_per_epoch": per_epoch,
    }

    # -- model and optimizer
    mx.random.seed(cfg.seed)
    drafter = DFlashDraftModel(dcfg)
    drafter.set_dtype(mx.float32)
    copied: list[str] = []
    if resumed is None and cfg.init == "target":
        copied = init_from_target(drafter, target)
    drafter.bind(target.embed, target.head)
    warm = max(1, round(cfg.warmup * total)) if cfg.warmup > 0 else 0
    peak, floor = cfg.lr, cfg.lr * MIN_LR_FRACTION
    if warm:
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(peak / warm, peak, warm),
                optim.cosine_decay(peak, max(1, total - warm), floor),
            ],
            [warm],
        )
    else:
        schedule = optim.cosine_decay(peak, total, floor)
    opt = optim.AdamW(
        learning_rate=schedule, betas=list(ADAM_BETAS), weight_decay=0.0, bias_correction=True
    )
    start = 0
    log: dict[str, Any] = {
        "command": "hf2q train-draft",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "target": {
            "source": str(cfg.target),
            "layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "embedding_rows": target.vocab_size,
        },
        "drafter_config": dcfg.to_dict(),
        "gamma": gamma,
        "init": copied,
        "data": data_stats,
        "total_steps": total,
        "history": [],
        "evals": [],
    }
    if resumed is not None:
        drafter.load_weights(str(ck_dir / "drafter.safetensors"))
        opt.init(drafter.trainable_parameters())
        from mlx.utils import tree_flatten, tree_unflatten

        saved = mx.load(str(ck_dir / "optimizer.safetensors"))
        flat = dict(tree_flatten(opt.state))
        flat.update(saved)
        opt.state = tree_unflatten(list(flat.items()))
        start = int(resumed["step"])
        log["history"] = resumed["log"]["history"]
        log["evals"] = resumed["log"]["evals"]
        log["resumed_at"] = log.get("resumed_at", []) + [start]
    else:
        ck_dir.mkdir(parents=True, exist_ok=True)
        D.save_dataset(ck_dir / "dataset.npz", seqs, prompts)
    mx.eval(drafter.parameters())

    weights = mx.array(loss_weights(B, gamma))
    ids = dcfg.target_layer_ids
    pad_id = int(getattr(tok, "pad_token_id", None) or (eos_ids[0] if eos_ids else 0))
    loss_and_grad = nn.value_and_grad(drafter, batch_loss)

    def state_dict(step: int) -> dict[str, Any]:
        return {
            "step": step,
            "total_steps": total,
            "drafter_config": dcfg.to_dict(),
            "gamma": gamma,
            "seed": cfg.seed,
            "log": log,
        }

    def evaluate(step: int) -> Iterator[Event]:
        if not prompts:
            return
        res = measure_tau(
            target,
            inference_copy(drafter, target),
            prompts,
            max_tokens=cfg.eval_max_tokens,
            eos_token_ids=eos_ids,
        )
        rec = {
            "step": step,
            "tau": res.tau,
            "acceptance_rate": res.acceptance_rate,
            "rounds": res.rounds,
            "prompts": res.prompts,
            "generated_tokens": res.generated_tokens,
            "seconds": round(res.seconds, 2),
        }
        log["evals"].append(rec)
        yield Evaluated(
            step,
            res.tau,
            res.acceptance_rate,
            res.rounds,
            res.prompts,
            res.generated_tokens,
            res.seconds,
        )

    yield Stage(
        "train",
        f"{n_seq} sequences, {total} steps (from {start}), drafter {dcfg.num_hidden_layers} layers, "
        f"ids {ids}, mask {dcfg.mask_token_id}, B {B}, gamma {gamma:g}",
    )
    if start == 0 and resumed is None:
        # A first checkpoint right away: a failure from here on leaves a run that --resume
        # continues, without preparing (regenerating) the data again.
        opt.init(drafter.trainable_parameters())
        _save_checkpoint(ck_dir, drafter, opt, state_dict(0))
        yield from evaluate(0)
    checkpoint_every = cfg.checkpoint_every or cfg.eval_every
    acc = {"loss": 0.0, "weight": 0.0, "correct": 0.0, "leading": 0.0, "blocks": 0.0, "n": 0}
    blocks_since = 0
    train_s = float((resumed or {}).get("log", {}).get("train_s", 0.0))
    # The target is frozen, so a sequence's features never change: when they fit in
    # --feature-cache-gb, compute them once (in the target's dtype) instead of once per visit.
    feat_dim = len(ids) * target.hidden_size
    itemsize = 2 if target.dtype in (mx.bfloat16, mx.float16) else 4
    cache_bytes = n_seq * cfg.seq_len * feat_dim * itemsize
    feature_cache = None
    if total * cfg.batch_size > n_seq and cache_bytes <= cfg.feature_cache_gb * 1e9:
        yield Stage("features", f"target features of {n_seq} sequences, {cache_bytes / 1e9:.2f} GB")
        parts = []
        fb = max(cfg.batch_size, cfg.regen_batch)  # a forward only: as wide as regeneration
        width_option = "--regen-batch" if fb == cfg.regen_batch else "--batch-size"
        with _wide_pass("the feature pass", width_option, fb):
            for i in range(0, n_seq, fb):
                chunk = D.make_batch(seqs[i : i + fb], cfg.seq_len, pad_id)
                _, f = target.forward(mx.array(chunk.tokens), capture=ids)
                mx.eval(f)
                parts.append(f)
                yield Preparing("features", min(n_seq, i + fb), n_seq)
        feature_cache = mx.concatenate(parts, axis=0)  # (n_seq, seq_len, n_ids*H)
        del parts
    log["feature_cache_bytes"] = cache_bytes if feature_cache is not None else 0

    batches = D.iterate_batches(seqs, cfg.batch_size, cfg.seq_len, pad_id, cfg.seed, start)
    step = start
    t_train = t_log = time.time()  # throughput counts training steps only
    for step0, idx, batch in batches:
        if step0 >= total:
            break
        rng = np.random.default_rng([cfg.seed, step0, 1])
        valid = valid_anchors(batch.lengths, batch.loss_mask, B)
        anchors, keep = sample_anchors(valid, cfg.anchors_per_seq, rng)
        blocks = make_blocks(
            batch.tokens, batch.loss_mask, batch.lengths, anchors, keep, B, dcfg.mask_token_id
        )
        N, A = anchors.shape
        # Frozen target: features of every position, and embeddings of the block tokens.
        if feature_cache is not None:
            feats = feature_cache[mx.array(idx)]
        else:
            _, feats = target.forward(mx.array(batch.tokens), capture=ids)
        feats = mx.stop_gradient(feats.astype(mx.float32))
        embeds = mx.stop_gradient(
            target.embed(mx.array(blocks.tokens.reshape(N * A, B))).astype(mx.float32)
        )
        (loss, metrics), grads = loss_and_grad(
            drafter,
            target.head,
            embeds,
            feats,
            mx.array(anchors),
            mx.array(blocks.labels.reshape(N * A, B - 1)),
            mx.array(blocks.label_mask.reshape(N * A, B - 1)),
            weights,
        )
        grads, _ = optim.clip_grad_norm(grads, cfg.clip)
        opt.update(drafter, grads)
        mx.eval(drafter.parameters(), opt.state, loss, metrics)
        step = step0 + 1
        acc["loss"] += float(loss)
        acc["n"] += 1
        for k in ("weight", "correct", "leading", "blocks"):
            acc[k] += float(metrics[k])
        blocks_since += int(keep.sum())
        if step % cfg.log_every == 0 or step == total:
            now = time.time()
            rec = {
                "step": step,
                "loss": acc["loss"] / acc["n"],
                "accuracy": acc["correct"] / max(acc["weight"], 1e-9),
                "train_tau": 1.0 + acc["leading"] / max(acc["blocks"], 1.0),
                "lr": float(schedule(mx.array(step - 1))),
                "blocks_per_s": blocks_since / max(now - t_log, 1e-9),
                "elapsed": round(train_s + now - t_train, 1),
            }
            log["history"].append(rec)
            yield StepDone(
                step,
                total,
                rec["loss"],
                rec["accuracy"],
                rec["train_tau"],
                rec["lr"],
                rec["blocks_per_s"],
                rec["elapsed"],
                step / per_epoch,
            )
            acc = dict.fromkeys(acc, 0.0)
            acc["n"] = 0
            blocks_since = 0
            t_log = time.time()
        out_of_time = (
            cfg.max_minutes is not None
            and train_s + time.time() - t_train >= cfg.max_minutes * 60
            and step != total
        )
        if out_of_time:
            # The schedule still follows --steps/--epochs: the run ends where the budget did.
            log["stopped_by_time"] = {"step": step, "planned_steps": total}
            yield Stage(
                "time", f"--max-minutes {cfg.max_minutes:g} reached at step {step} of {total}"
            )
            break
        if step % cfg.eval_every == 0 and step != total:
            yield from evaluate(step)
        if step % checkpoint_every == 0 and step != total:
            log["train_s"] = round(train_s + time.time() - t_train, 1)
            _save_checkpoint(ck_dir, drafter, opt, state_dict(step))

    yield from evaluate(step)
    log["train_s"] = round(train_s + time.time() - t_train, 1)
    _save_checkpoint(ck_dir, drafter, opt, state_dict(step))

    yield Stage("save", str(out))
    dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[cfg.save_dtype]
    final = DFlashDraftModel(dcfg)
    from mlx.utils import tree_flatten

    final.load_weights([(k, v.astype(dtype)) for k, v in tree_flatten(drafter.parameters())])
    tmp = out / ".final.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_drafter(final, tmp)
    log["wall_s"] = round(time.time() - t_start, 1)
    log["steps"] = step
    (tmp / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()
    yield Finished(out, step, log)
