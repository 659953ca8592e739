"""Tiny checkpoints for tests, written by ``transformers`` itself in the genuine Hugging Face layout.

Each builder writes a folder the way a released checkpoint looks (config.json, safetensors,
tokenizer files, generation_config.json), only much smaller: hidden 64, 4-8 layers, a byte-level
BPE tokenizer of about 400 tokens trained here on a fixed text. DFlash drafters are written in
z-lab's format (config.json with ``dflash_config`` + one safetensors file with their tensor names).

``scripts/make_fixtures.py`` calls these to write the same folders by hand.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
VOCAB_SIZE = 512  # embedding rows; the tokenizer uses fewer, so the last rows are free for MASK
MASK_TOKEN_ID = VOCAB_SIZE - 1

# Fixed training text for the test tokenizer, so token ids do not depend on the machine.
_TOKENIZER_TEXT = """
The quick brown fox jumps over the lazy dog. A speculative decoder drafts several tokens and the
target model verifies them in one forward pass; accepted tokens are kept and the rest roll back.
def add(a, b):
    return a + b

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

for i in range(10):
    print(i, i * i, "square")
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } = + - * / %
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a small model that learned to write Python code and short stories.
"""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def write_tokenizer(folder: str | Path, vocab_size: int = 400) -> dict[str, int]:
    """Train a small byte-level BPE and save it as a transformers tokenizer; return special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def qwen35_text_config(**overrides: Any) -> dict[str, Any]:
    """A tiny Qwen3.5 text config: 3 Gated-DeltaNet layers then 1 full-attention layer, x layers/4."""
    cfg: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    cfg.update(overrides)
    return cfg


def _finish(
    folder: Path, model: Any, *, dtype: str, eos_ids: list[int], max_shard_size: str | None = None
) -> None:
    import torch

    model = model.to(
        {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    )
    if max_shard_size is not None:
        model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    else:
        model.save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_ids, "pad_token_id": eos_ids[-1]}, indent=2)
    )


def _init(model: Any, seed: int, std: float) -> Any:
    """Re-initialise weights with a larger scale than HF's 0.02 so tiny models have peaked logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "visual" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def training_ids(folder: str | Path) -> list[int]:
    """Token ids of the fixed text, with the tokenizer written in ``folder``."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(folder)).encode(_TOKENIZER_TEXT))


def _train(model: Any, ids: list[int], steps: int, seed: int, lr: float = 1e-2) -> float:
    """Fit the model to the fixed text for a few steps, so its next-token choices are confident.

    Random tiny models give nearly flat (or chaotic) distributions, on which "top-1 agreement"
    means nothing; after a few dozen AdamW steps the model predicts the text's next tokens with
    high probability and depends on every layer to do so. Runs on one thread: on the shared 2-core
    machine two torch threads are many times slower than one.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        window = 64
        x = torch.tensor([ids[i : i + window] for i in range(0, len(ids) - window - 1, window)])
        y = torch.tensor(
            [ids[i + 1 : i + window + 1] for i in range(0, len(ids) - window - 1, window)]
        )
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model.train()
        loss = torch.tensor(0.0)
        for _ in range(steps):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        return loss.item()
    finally:
        torch.set_num_threads(threads)


def build_qwen35(
    folder: str | Path,
    *,
    layout: str = "conditional",
    moe: bool = False,
    mtp: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    std: float = 0.08,
    train_steps: int = 0,
    max_shard_size: str | None = None,
    **text_overrides: Any,
) -> Path:
    """Write a tiny Qwen3.5 checkpoint.

    Args:
        layout: ``"conditional"`` (released ``*ForConditionalGeneration``, vision tower included,
            weights under ``model.language_model``) or ``"causal"`` (text-only ``*ForCausalLM``).
        moe: a ``qwen3_5_moe`` model (4 experts, 2 per token, a shared expert).
        mtp: add ``mtp.*`` tensors (one extra decoder layer + norms + fc) as released checkpoints have.
        train_steps: fit the model to the fixed tokenizer text for this many steps first (see
            :func:`_train`), so its predictions on that text are confident.
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"100KB"``) to write several shards
            and a ``model.safetensors.index.json``.
    """
    import torch
    import transformers as tf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(folder)
    torch.manual_seed(seed)
    text = qwen35_text_config(**text_overrides)
    if moe:
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
        text.pop("intermediate_size", None)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text["hidden_size"],
    )
    if layout == "conditional":
        if moe:
            cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
            model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
        else:
            cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision)
            model = tf.Qwen3_5ForConditionalGeneration(cfg)
    elif layout == "causal":
        if moe:
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text))
        else:
            model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    _init(model, seed, std)
    if train_steps:
        _train(model, training_ids(folder), train_steps, seed)
    model.eval()
    _finish(
        folder,
        model,
        dtype=dtype,
        eos_ids=[special["<|im_end|>"], special["<|endoftext|>"]],
        max_shard_size=max_shard_size,
    )
    if mtp:
        add_mtp_tensors(folder, hidden=text["hidden_size"], seed=seed)
    return folder


def add_mtp_tensors(folder: Path, *, hidden: int, seed: int = 0) -> list[str]:
    """Add ``mtp.*`` tensors to the checkpoint's (single) safetensors file, as released models have."""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(folder.glob("*.safetensors"))
    target = files[-1]
    tensors = load_file(str(target))
    dtype = next(iter(tensors.values())).dtype
    gen = torch.Generator().manual_seed(seed + 1)
    shapes = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
        "mtp.layers.0.input_layernorm.weight": (hidden,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * hidden, hidden),
        "mtp.layers.0.mlp.gate_proj.weight": (2 * hidden, hidden),
    }
    for name, shape in shapes.items():
        tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    save_file(tensors, str(target), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        for name in shapes:
            data["weight_map"][name] = target.name
        index.write_text(json.dumps(data, indent=2))
    return list(shapes)


def build_qwen3(
    folder: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    std: float = 0.08,
    train_steps: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny plain Qwen3 (pure attention) checkpoint (``train_steps``: see build_qwen35)."""
    import torch
    import transformers as tf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    cfg.update(overrides)
    model = _init(tf.Qwen3ForCausalLM(tf.Qwen3Config(**cfg)), seed, std)
    if train_steps:
        _train(model, training_ids(folder), train_steps, seed)
    model.eval()
    _finish(folder, model, dtype=dtype, eos_ids=[special["<|im_end|>"], special["<|endoftext|>"]])
    return folder


def drafter_config(
    *,
    hidden_size: int = 64,
    num_target_layers: int = 4,
    layers: int = 1,
    target_layer_ids: list[int] | None = None,
    block_size: int = 16,
    mask_token_id: int = MASK_TOKEN_ID,
    vocab_size: int = VOCAB_SIZE,
    **overrides: Any,
) -> dict[str, Any]:
    """A z-lab DFlash drafter config.json for a tiny target."""
    ids = (
        target_layer_ids
        if target_layer_ids is not None
        else sorted({1, max(1, num_target_layers - 2)})
    )
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 2 * hidden_size,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
    }
    cfg.update(overrides)
    return cfg


def build_drafter(
    folder: str | Path,
    *,
    seed: int = 0,
    std: float = 0.08,
    dtype: str = "float32",
    **cfg_kwargs: Any,
) -> Path:
    """Write a random DFlash drafter in z-lab's layout (config.json + model.safetensors)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config(**cfg_kwargs)
    H, D = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, inter = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )
    n_ids = len(cfg["dflash_config"]["target_layer_ids"])
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> Any:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * std)

    def ones(n: int) -> Any:
        return torch.from_numpy((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    tensors = {"fc.weight": w(H, n_ids * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": ones(H),
                p + "post_attention_layernorm.weight": ones(H),
                p + "self_attn.q_proj.weight": w(nh * D, H),
                p + "self_attn.k_proj.weight": w(nkv * D, H),
                p + "self_attn.v_proj.weight": w(nkv * D, H),
                p + "self_attn.o_proj.weight": w(H, nh * D),
                p + "self_attn.q_norm.weight": ones(D),
                p + "self_attn.k_norm.weight": ones(D),
                p + "mlp.gate_proj.weight": w(inter, H),
                p + "mlp.up_proj.weight": w(inter, H),
                p + "mlp.down_proj.weight": w(H, inter),
            }
        )
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    save_file(
        {k: v.to(tdtype).contiguous() for k, v in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def add_to_hf_cache(
    cache: str | Path, repo_id: str, folder: str | Path, *, revision: str = "main"
) -> str:
    """Place ``folder``'s files in a Hugging Face Hub cache as if ``repo_id`` had been downloaded.

    Lays out huggingface_hub's documented cache structure, ``models--owner--name/`` with
    content-addressed ``blobs/``, ``snapshots/<commit>/`` of relative symlinks to the blobs, and
    ``refs/<revision>`` holding the commit, so that ``snapshot_download(repo_id)`` with
    ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE=cache`` resolves it. Returns the (made-up) commit hash.
    """
    import hashlib
    import os

    folder = Path(folder)
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in folder.iterdir() if p.is_file())
    digest = hashlib.sha1()
    for p in files:
        digest.update(p.name.encode() + hashlib.sha256(p.read_bytes()).digest())
    commit = digest.hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = repo / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        if not blob.exists():
            blob.write_bytes(p.read_bytes())
        link = snapshot / p.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


#: mlx-lm ``qwen3_5.TextModelArgs`` of the tiny hybrid text model of :func:`qwen35_text_config`
#: (3 Gated-DeltaNet layers and one attention layer, vocabulary 64) for kernel tests that build
#: mlx-lm models directly, without a checkpoint.
TINY_TEXT_ARGS = dict(model_type="qwen3_5_text", **qwen35_text_config(vocab_size=64))
