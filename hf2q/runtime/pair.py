"""Load a target and its DFlash drafter as a validated pair, and turn a prompt into token ids.

What it does: resolve the target (``hf2q.loading.load_model``: local folder, converted folder or
Hub id) and the drafter (``--draft``, else the drafter registry ``configs/registry.toml``, else
the embedded demo pair when no model is given at all), load the drafter in the target's dtype,
check that the two fit (hidden size, vocabulary rows, layer count, layer ids, mask id), bind the
drafter to the target's embedding and head, and encode prompts (chat template with optional
thinking, or raw text).

What it does not do: generate (``hf2q.runtime.dflash``) or print.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf2q.errors import DrafterError, ModelError, UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _package_dir() -> Path:
    import hf2q

    return Path(hf2q.__file__).resolve().parent


def configs_dir() -> Path | None:
    """``configs/`` shipped in the package (wheel), else the repository's top-level one."""
    pkg = _package_dir()
    for cand in (pkg / "configs", pkg.parent / "configs"):
        if (cand / "registry.toml").is_file():
            return cand
    return None


def read_registry() -> dict[str, Any]:
    """The parsed drafter registry (empty when none is installed)."""
    folder = configs_dir()
    if folder is None:
        return {}
    path = folder / "registry.toml"
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ModelError(f"{path} is not valid TOML ({exc}): fix or reinstall it") from exc


def registry_entry(source: str) -> dict[str, Any] | None:
    """The registry entry of a target source (exact Hub id as written in the registry)."""
    return (read_registry().get("targets") or {}).get(str(source))


def demo_pair() -> tuple[Path, Path, dict[str, Any]]:
    """Folders of the embedded demo pair and its registry entry.

    Raises:
        ModelError: this installation has no demo pair.
    """
    entry = read_registry().get("demo") or {}
    pkg = _package_dir()
    target = pkg / entry.get("target", "demo/target")
    draft = pkg / entry.get("draft", "demo/draft")
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise ModelError(
            "this hf2q installation has no embedded demo pair: pass a target with --model "
            "(and its drafter with --draft)"
        )
    return target, draft, entry


@dataclass
class Pair:
    """A loaded target, its drafter (None for plain decoding) and how to prompt them."""

    target: Any  # TargetModel
    drafter: Any | None  # DFlashDraftModel, bound to the target
    tokenizer: Any  # mlx-lm TokenizerWrapper
    target_source: str
    draft_source: str | None
    chat_default: bool  # apply the chat template unless told otherwise
    default_prompt: str | None = None  # the demo pair's prompt when none is given

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(int(i) for i in (self.tokenizer.eos_token_ids or ()))


def validate_pair(target: Any, drafter_config: Any, where: str = "the drafter") -> None:
    """Raise :class:`DrafterError` unless the drafter config fits the target's sizes."""
    drafter_config.validate_for_target(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_layers=target.num_layers,
        where=where,
    )


def load_pair(
    model: str | None,
    draft: str | None = None,
    *,
    dflash: bool = True,
    revision: str | None = None,
    draft_head_bits: int = 0,
    draft_vocab: int = 0,
) -> Pair:
    """Load the target (and with ``dflash`` its drafter) and validate the pair.

    Args:
        model: target source; None runs the embedded demo pair.
        draft: drafter source; None looks the target up in the registry.
        dflash: load the drafter (False: plain decoding, the drafter is not needed).
        revision: Hub revision of the target.
        draft_head_bits: 4 or 8: the drafter binds a quantized copy of the target's head
            (``TargetModel.draft_head``); 0: the head itself.
        draft_vocab: K > 0: drafts propose from ``TargetModel.draft_vocab_ids(K)`` only (the
            head's rows of those ids); 0: the whole vocabulary.

    Raises:
        ModelError / DrafterError / SourceError / UsageError: one line naming the fix.
    """
    from hf2q.hub import resolve_source
    from hf2q.loading import load_model
    from hf2q.runtime.drafter import load_drafter, load_drafter_config
    from hf2q.runtime.target import TargetModel

    entry: dict[str, Any] = {}
    is_demo = model is None
    if model is None:
        demo_target, demo_draft, entry = demo_pair()
        model = str(demo_target)
        draft = draft or str(demo_draft)
    else:
        entry = registry_entry(model) or {}
        if draft is None and dflash:
            draft = entry.get("draft")
            if draft is None:
                raise UsageError(
                    f"no drafter is registered for {model}: pass one with --draft, or use --no-dflash"
                )
    loaded = load_model(model, revision=revision)
    target = TargetModel(loaded.model, loaded.tokenizer)
    drafter = None
    if dflash:
        folder = resolve_source(draft)
        cfg = load_drafter_config(folder)
        validate_pair(target, cfg, where=f"drafter {draft}")
        drafter = load_drafter(folder, dtype=target.dtype)
        drafter.bind(target.embed, target.draft_head(draft_head_bits, draft_vocab))
    has_template = bool(getattr(loaded.tokenizer, "chat_template", None))
    chat_default = bool(entry.get("chat", True)) and has_template
    return Pair(
        target,
        drafter,
        loaded.tokenizer,
        str(model),
        draft if dflash else None,
        chat_default,
        entry.get("prompt") if is_demo else None,
    )


def encode_prompt(
    tokenizer: Any, text: str, *, chat: bool, thinking: bool | None = None
) -> list[int]:
    """Token ids of ``text``: one user turn through the chat template, or the raw text.

    Args:
        chat: apply the tokenizer's chat template (with the generation prompt).
        thinking: pass ``enable_thinking`` to the template (None: the template's default).

    Raises:
        UsageError: empty prompt, or ``chat`` for a tokenizer without a chat template.
    """
    if not text.strip():
        raise UsageError("the prompt is empty: pass some text (argument, --prompt-file or stdin)")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("this model's tokenizer has no chat template: pass --no-chat")
        kwargs = {} if thinking is None else {"enable_thinking": bool(thinking)}
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def check_model_sources(model: str | None, draft: str | None) -> None:
    """Cheap checks before loading anything (used by the CLI)."""
    if model is not None and not str(model).strip():
        raise UsageError("--model is empty: pass a model folder or Hub repo id")
    if draft is not None and not str(draft).strip():
        raise DrafterError("--draft is empty: pass a drafter folder or Hub repo id")


#: What ``--dtype`` accepts: a floating-point type, ``auto`` (see :func:`auto_dtype`) or ``native``.
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", "native", *DTYPES)


def cast_models(target: Any, drafter: Any | None, dtype: str) -> None:
    """Cast the floating-point weights of ``target`` (and ``drafter``) to ``dtype`` in place.

    Gated-DeltaNet ``A_log`` stays float32 (as mlx-lm loads it); quantized weights keep their
    packing (only their scales and biases follow ``dtype``).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    dt = getattr(mx, dtype)
    models = [target.model] + ([drafter] if drafter is not None else [])
    for model in models:
        params = [
            (k, v.astype(dt))
            for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("A_log") and v.dtype != dt
        ]
        if params:
            model.update(tree_unflatten(params))
    mx.eval([m.parameters() for m in models])
    target.refresh_draft_heads()  # a quantized draft head follows the head's new weight


def auto_dtype(
    target: Any, drafter: Any | None, *, memory_share: float = 0.4, blas: str | None = None
) -> str | None:
    """The compute dtype ``--dtype auto`` picks on a CPU: float32 for half-precision weights,
    except bfloat16 ones under the reference BLAS, which stay bfloat16.

    MLX's CPU float32 matrix products run the BLAS, its bfloat16 ones its own code. With an
    optimized BLAS (OpenBLAS, MKL, Accelerate) float32 wins: with MKL, DFlash on the demo pair
    ran 126.3 tok/s in float32 against 44.4 in bf16, plain decoding 81.0 against 50.4
    (``benchmarks/dtype_ab.py``, medians, session 53). With the reference BLAS that Linux's
    ``mlx[cpu]`` wheel bundles, bf16 products are faster (16 x 2560 x 9216: 230 ms against 606 in
    float32) and DFlash ran 45.2 tok/s in bf16 against 20.8 in float32, plain decoding 46.6
    against 50.0: so bf16 weights are kept there, for plain decoding and DFlash alike (a user
    comparing the two gets the same tokens). float16 weights widen under either BLAS (a float16
    one-row product: 105 ms against 30 in float32, session 53).

    Quantized products are slower still with half-precision scales and activations, under any
    BLAS: the demo target quantized to 4 bits decoded 15.3 tok/s (DFlash 2.1) with bf16 and 83.6
    (DFlash 18.1) with float32 scales, biases and activations (session 34). So a quantized model
    always widens: its layers keep their packed matrices (only their scales and biases widen,
    :func:`cast_models`).

    Half-precision weights widen only when the float32 copy stays under ``memory_share`` of
    the machine's RAM. GPUs and float32 models keep their dtype (None: no cast). ``blas`` is the
    CPU BLAS's kind as :func:`hf2q.platform.blas_kind` names it (None: the one loaded).
    """
    import os

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from hf2q import platform
    from hf2q.kernels import select

    if select.backend() != "cpu":
        return None
    models = [target.model] + ([drafter] if drafter is not None else [])
    half = 0
    kinds = set()
    for model in models:
        for _, v in tree_flatten(model.parameters()):
            if v.dtype in (mx.bfloat16, mx.float16):
                half += v.nbytes
                kinds.add(v.dtype)
    if half == 0:
        return None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        return None
    if 2 * half > memory_share * ram:
        return None
    if blas is None:
        blas = platform.blas_kind(platform.loaded_blas())
    keep_bf16 = blas == platform.REFERENCE_BLAS and kinds == {mx.bfloat16}
    if keep_bf16 and not any(is_quantized(m) for m in models):
        return None
    return "float32"


def is_quantized(model: Any) -> bool:
    """Whether ``model`` has quantized layers (``nn.QuantizedLinear`` / ``QuantizedEmbedding``)."""
    import mlx.nn as nn

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return any(isinstance(m, kinds) for _, m in model.named_modules())


def dflash_cpu_note(target: Any) -> str | None:
    """What ``hf2q generate --dflash`` tells a user of a quantized target on a CPU (None
    elsewhere): MLX's CPU quantized product costs about linearly in its rows (float32, 1024 x
    1024, 4-bit: 0.87 ms for one row, 11.8 for 16; session 34), so a 16-token verify costs
    about as much as a dozen decode steps and DFlash loses to plain decoding, where an
    unquantized model's verify runs the BLAS."""
    from hf2q.kernels import select

    if select.backend() != "cpu" or not is_quantized(target.model):
        return None
    return (
        "this target is quantized: MLX's CPU quantized products cost about as much per row as "
        "a decode step, so DFlash's 16-token verifies make it slower than plain decoding here "
        "(the demo target converted to 4 bits: 78 against 98 tok/s); for DFlash on this CPU use the "
        "unquantized (bf16) model, or pass --no-dflash"
    )


def apply_dtype(target: Any, drafter: Any | None, choice: str | None) -> str:
    """Apply a ``--dtype`` choice (None = ``auto``); return the dtype the embedding ends up in."""
    choice = choice or "auto"
    if choice not in DTYPE_CHOICES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {choice!r}")
    dtype = (
        auto_dtype(target, drafter) if choice == "auto" else None if choice == "native" else choice
    )
    if dtype is not None:
        cast_models(target, drafter, dtype)
    return str(target.dtype).removeprefix("mlx.core.")
