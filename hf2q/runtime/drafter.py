"""The DFlash block-diffusion drafter in the z-lab checkpoint format: config, model, load, save.

What it does: parse and validate a drafter ``config.json`` (refusing DFlash2 and vendor formats),
build the MLX model whose parameter names are z-lab's tensor names, run one drafting forward
(a block ``[last_token, MASK x (B-1)]`` attending non-causally to target features of the verified
context plus the block itself), and write a drafter back in the same layout.

What it does not do: own an embedding or an lm_head (the target's are bound at run time), decide
acceptance, or touch the target's caches. Facts about the format: ``shared/docs/dflash.md``.
"""

from __future__ import annotations

import inspect
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from hf2q.errors import DrafterError
from hf2q.kernels import cuda_attention
from hf2q.kernels.attention import positions, reads_buffer_in_place
from hf2q.kernels.gdn import concat_linears, mlp_fused
from hf2q.kernels.linear import FROZEN, Frozen, kept, linear, normed, swiglu_mlp
from hf2q.kernels.select import (
    bucketed,
    compile_draft_enabled,
    compile_enabled,
    draft_mm_enabled,
    fuse_proj_enabled,
    row_attention_enabled,
    sdpa_bucket,
    small_mm_enabled,
)
from hf2q.runtime.draft_graph import CompiledDraft

DRAFTER_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced target layers from 1 to N-3 (SpecForge's and z-lab's training rule)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [
        round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]


def check_drafter_format(cfg: dict[str, Any], where: str = "the drafter") -> None:
    """Raise :class:`DrafterError` unless ``cfg`` is a DFlash (v1) drafter config in z-lab's format."""
    archs = [str(a) for a in cfg.get("architectures") or []]
    dflash = cfg.get("dflash_config") or {}
    if "DFlash2DraftModel" in archs or any(
        int(dflash.get(k, 0) or 0) > 0
        for k in ("conv_kernel_size", "selector_rank", "selector_top_k")
    ):
        raise DrafterError(
            f"{where} is a DFlash2 drafter (DFlash2DraftModel), which hf2q does not support yet: "
            "use a DFlash drafter such as z-lab/Qwen3.5-4B-DFlash"
        )
    if "speculators_config" in cfg or "aux_hidden_state_layer_ids" in json.dumps(cfg):
        raise DrafterError(
            f"{where} is in the vendor 'speculators' format, which hf2q does not read: use a "
            "drafter in z-lab's DFlash format (config.json with dflash_config)"
        )
    if DRAFTER_ARCHITECTURE not in archs and "dflash_config" not in cfg:
        name = archs[0] if archs else cfg.get("model_type", "unknown")
        raise DrafterError(
            f"{where} is not a DFlash drafter (architecture {name}): pass a drafter whose "
            f"config.json names {DRAFTER_ARCHITECTURE} and has dflash_config"
        )


@dataclass
class DFlashConfig:
    """The fields of a z-lab DFlash drafter ``config.json`` that the model uses."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    attention_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str = "the drafter") -> DFlashConfig:
        """Parse a z-lab drafter config; raise :class:`DrafterError` naming what is wrong."""
        check_drafter_format(cfg, where)
        dflash = dict(cfg.get("dflash_config") or {})
        need = [
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        ]
        missing = [k for k in need if k not in cfg]
        if "mask_token_id" not in dflash:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise DrafterError(
                f"{where}'s config.json lacks {', '.join(missing)}: it is not a complete DFlash drafter config"
            )
        n_layers = int(cfg["num_hidden_layers"])
        num_target_layers = cfg.get("num_target_layers", dflash.get("num_target_layers"))
        ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is None:
            if num_target_layers is None:
                raise DrafterError(
                    f"{where}'s config.json has neither dflash_config.target_layer_ids nor num_target_layers: add target_layer_ids"
                )
            ids = default_target_layer_ids(int(num_target_layers), n_layers)
        if num_target_layers is None:
            raise DrafterError(
                f"{where}'s config.json lacks num_target_layers: add the target's layer count"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        layer_types = list(cfg.get("layer_types") or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers:
            raise DrafterError(
                f"{where}'s layer_types has {len(layer_types)} entries for {n_layers} layers: make them match"
            )
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise DrafterError(
                f"{where} has unsupported layer types {unknown} (supported: {', '.join(LAYER_TYPES)})"
            )
        if "sliding_attention" in layer_types and not cfg.get("sliding_window"):
            raise DrafterError(
                f"{where} has sliding_attention layers but no sliding_window: add sliding_window to config.json"
            )
        known = set(need) | {
            "head_dim",
            "num_target_layers",
            "block_size",
            "rms_norm_eps",
            "rope_theta",
            "rope_parameters",
            "rope_scaling",
            "max_position_embeddings",
            "layer_types",
            "sliding_window",
            "is_causal",
            "attention_bias",
            "dflash_config",
        }
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            num_target_layers=int(num_target_layers),
            target_layer_ids=list(ids),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            layer_types=layer_types,
            sliding_window=cfg.get("sliding_window"),
            is_causal=cfg.get("is_causal"),
            attention_bias=bool(cfg.get("attention_bias", False)),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The config.json z-lab's loaders read (target_layer_ids always written explicitly)."""
        cfg: dict[str, Any] = dict(self.extra)
        cfg.update(
            {
                "architectures": [DRAFTER_ARCHITECTURE],
                "model_type": cfg.get("model_type", "qwen3"),
                "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings,
                "attention_bias": self.attention_bias,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "layer_types": list(self.layer_types),
                "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "dflash_config": {
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": list(self.target_layer_ids),
                    "block_size": self.block_size,
                },
            }
        )
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = self.rope_scaling
        if self.sliding_window is not None:
            cfg["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        return cfg

    def validate_for_target(
        self, *, hidden_size: int, vocab_size: int, num_layers: int, where: str = "the drafter"
    ) -> None:
        """Raise :class:`DrafterError` if this drafter cannot draft for a target of these sizes."""
        if self.hidden_size != hidden_size:
            raise DrafterError(
                f"{where} has hidden size {self.hidden_size} but the target has {hidden_size}: "
                "pass the drafter trained for this target"
            )
        if self.num_target_layers != num_layers:
            raise DrafterError(
                f"{where} was trained for a target of {self.num_target_layers} layers but the target "
                f"has {num_layers}: pass the drafter trained for this target"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise DrafterError(
                f"{where}'s target_layer_ids {bad} are outside the target's {num_layers} layers: fix dflash_config.target_layer_ids"
            )
        if self.vocab_size != vocab_size:
            raise DrafterError(
                f"{where} has vocab size {self.vocab_size} but the target's embedding has "
                f"{vocab_size} rows: pass the drafter trained for this target"
            )
        if not 0 <= self.mask_token_id < vocab_size:
            raise DrafterError(
                f"{where}'s mask_token_id {self.mask_token_id} is outside the target's embedding "
                f"(0..{vocab_size - 1}): fix dflash_config.mask_token_id"
            )


@dataclass
class DraftPass:
    """What the layers of one drafter forward share: the attention masks made so far (all layers
    see the same positions), and the switches read once a forward: whether projections are
    concatenated (``HF2Q_FUSE_PROJ``), the key-length bucket (``sdpa_bucket()``), whether
    products go through the small-M kernel (``small_mm_enabled()``; never in training) and
    whether layers run compiled around the row attention kernel (``fast``, see
    :meth:`DFlashDecoderLayer.fast_supported`)."""

    masks: dict[Any, mx.array | None] = field(default_factory=dict)
    fuse: bool = False
    bucket: int | None = None
    mm: bool = False
    fast: bool = False


def _layer_weights(layer: DFlashDecoderLayer) -> list[mx.array]:
    """The arrays of a drafter layer, by attribute (cheaper than ``parameters()`` per forward)."""
    a, m = layer.self_attn, layer.mlp
    mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, a.q_norm, a.k_norm, m.gate_proj, m.up_proj)
    mods += (m.down_proj, layer.input_layernorm, layer.post_attention_layernorm)
    return [mod.weight for mod in mods] + [mod.bias for mod in mods if "bias" in mod]


class _CompiledLayer:
    """``mx.compile``'d pieces of one drafter layer for inference; the layer's weights are
    constants of the traces (:func:`hf2q.kernels.linear.kept` rebuilds it when they change).
    Products off the small-M kernel read their weights through kept transposed views
    (:data:`hf2q.kernels.linear.FROZEN`: one graph node less a product, the same bits)."""

    def __init__(self, layer: DFlashDecoderLayer, mm: bool) -> None:
        ref = weakref.ref(layer)  # the drafter owns the layer; these functions must not keep it
        mm = mm or FROZEN

        def context(ctx: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
            return ref().self_attn.keys_values(ctx, offset, mm)

        def block(x: mx.array, offset: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            lay = ref()
            h = lay.input_layernorm(x)
            k, v = lay.self_attn.keys_values(h, offset, mm)
            return lay.self_attn.queries(h, offset, mm), k, v

        def joint(
            x: mx.array, ctx: mx.array, offset: mx.array
        ) -> tuple[mx.array, mx.array, mx.array]:
            # Context rows then block rows through one k and one v product (rows are
            # independent: the same bits as two calls where the products are row-invariant).
            lay = ref()
            h = lay.input_layernorm(x)
            k, v = lay.self_attn.keys_values(mx.concatenate([ctx, h], axis=1), offset, mm)
            return lay.self_attn.queries(h, offset + ctx.shape[1], mm), k, v

        def post(x: mx.array, o: mx.array) -> mx.array:
            # o: (B, L, heads, d) attention output in row order.
            # The residuals join the products' launches where the kernel allows it (same bits
            # as the separate adds: hf2q.kernels.linear.linear).
            lay = ref()
            B, L, _ = x.shape
            h = linear(lay.self_attn.o_proj, o.reshape(B, L, -1), mm, add=x)
            return swiglu_mlp(lay.mlp, normed(lay.post_attention_layernorm, h, mm), mm, add=h)

        self.context, self.block, self.joint, self.post = (
            mx.compile(context),
            mx.compile(block),
            mx.compile(joint),
            mx.compile(post),
        )


def _concatenated(owner: nn.Module, name: str, mods: list[nn.Module]) -> nn.Module | None:
    """One linear computing ``mods`` side by side (``HF2Q_FUSE_PROJ``; None for layers with a
    bias), kept on ``owner`` (see :func:`hf2q.kernels.linear.kept`)."""
    if any("bias" in m for m in mods):
        return None
    return kept(owner, name, [m.weight for m in mods], lambda: concat_linears(mods))


class DFlashAttention(nn.Module):
    """Attention of one drafter layer: queries from the block, keys/values from context + block."""

    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        dim, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None
        # z-lab's convention: sliding layers are causal inside the block unless is_causal says otherwise.
        self.is_causal = sliding if cfg.is_causal is None else bool(cfg.is_causal)
        self.rope = initialize_rope(
            cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)  # (B, n, L, d)

    def queries(self, x: mx.array, offset: int | mx.array, mm: bool | Frozen = False) -> mx.array:
        """Normed, rotated queries of block rows ``x`` (B, L, H) starting at position ``offset``
        (``mm``: the projection through :func:`hf2q.kernels.linear.linear`)."""
        q = self._heads(linear(self.q_proj, x, mm), self.n_heads)
        return self.rope(self.q_norm(q), offset=offset)

    def keys_values(
        self, x: mx.array, offset: int | mx.array, mm: bool | Frozen = False
    ) -> tuple[mx.array, mx.array]:
        """Normed, rotated keys and values of rows ``x`` (B, L, H) starting at position ``offset``."""
        k = self.k_norm(self._heads(linear(self.k_proj, x, mm), self.n_kv_heads))
        return self.rope(k, offset=offset), self._heads(linear(self.v_proj, x, mm), self.n_kv_heads)

    def project(
        self, x: mx.array, ctx: mx.array, cache: Any, fuse: bool = False, mm: bool = False
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Append the keys/values of context rows ``ctx`` (B, S, H) to ``cache``; return the block
        rows' queries, keys and values (B, heads, L, d), rotated at the positions after the context.

        With ``fuse`` (``HF2Q_FUSE_PROJ``) one matmul computes q/k/v of the context and block rows
        together (same values; fewer, larger matmuls), else the separate projections as in
        training. ``mm``: products through the small-M kernel (:mod:`hf2q.kernels.linear`).
        """
        qkv = _concatenated(self, "_qkv", [self.q_proj, self.k_proj, self.v_proj]) if fuse else None
        if qkv is None:
            self.append_context(ctx, cache, mm)
            n_ctx = cache.offset
            k_blk, v_blk = self.keys_values(x, n_ctx, mm)
            return self.queries(x, n_ctx, mm), k_blk, v_blk
        S = ctx.shape[1]
        nq, nk = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        rows = mx.concatenate([ctx, x], axis=1) if S else x  # (B, S + L, H)
        q, k, v = mx.split(linear(qkv, rows, mm), [nq, nq + nk], axis=-1)
        k = self.k_norm(self._heads(k, self.n_kv_heads))  # (B, hk, S + L, d)
        v = self._heads(v, self.n_kv_heads)
        if S:
            cache.update_and_fetch(self.rope(k[:, :, :S], offset=cache.offset), v[:, :, :S])
        n_ctx = cache.offset
        q = self.rope(self.q_norm(self._heads(q[:, S:], self.n_heads)), offset=n_ctx)
        return q, self.rope(k[:, :, S:], offset=n_ctx), v[:, :, S:]

    def attend(
        self,
        q: mx.array,
        ks: list[mx.array],
        vs: list[mx.array],
        make_mask: Callable[[], mx.array | None],
        fw: DraftPass | None = None,
    ) -> mx.array:
        """Scaled dot-product attention over the keys/values ``ks``/``vs`` joined on the position
        axis (context, then block), and the output projection; returns (B, L, H).

        Where ``sdpa_bucket()`` asks for it (CUDA), the join also zero-pads the keys to a multiple
        of the bucket and the padding is masked out: same attention, one shape for many rounds.
        ``make_mask()`` gives the mask over the unpadded keys; with ``fw`` (one per drafter forward,
        whose layers all see the same positions) it runs once per kind of layer and the other
        layers reuse its (padded) result.
        """
        n = sum(k.shape[2] for k in ks)
        K = bucketed(n, fw.bucket if fw is not None else sdpa_bucket())
        L = q.shape[2]
        key = (self.is_causal, self.sliding_window, n, L)
        memo = fw.masks if fw is not None else None
        if memo is not None and key in memo:
            mask = memo[key]
        else:
            mask = make_mask()
            if n != K:
                pad = K - n
                if mask is None:
                    mask = mx.broadcast_to(mx.arange(K) < n, (L, K))
                else:
                    mask = mx.concatenate(
                        [mask, mx.zeros((*mask.shape[:-1], pad), dtype=mx.bool_)], axis=-1
                    )
            if memo is not None:
                memo[key] = mask
        if n != K:
            pad = K - n
            ks = [*ks, mx.zeros((*ks[0].shape[:2], pad, ks[0].shape[3]), ks[0].dtype)]
            vs = [*vs, mx.zeros((*vs[0].shape[:2], pad, vs[0].shape[3]), vs[0].dtype)]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        B, _, L, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return linear(self.o_proj, out, fw is not None and fw.mm)

    def block_mask(self, n_ctx: int, n_block: int, ctx_start: int) -> mx.array | None:
        """Boolean mask (n_block, n_ctx + n_block) for the block rows at positions after the context.

        ``ctx_start`` is the absolute position of the first context key kept in view; the block
        starts right after the last context key.
        """
        if not self.is_causal and self.sliding_window is None:
            return None
        q_pos = ctx_start + n_ctx + mx.arange(n_block)[:, None]
        k_pos = ctx_start + mx.arange(n_ctx + n_block)[None, :]
        visible = mx.ones((n_block, n_ctx + n_block), dtype=mx.bool_)
        if self.is_causal:
            visible = visible & (k_pos <= q_pos)
        if self.sliding_window is not None:
            visible = visible & (q_pos - k_pos < self.sliding_window)
        return visible

    def append_context(self, ctx: mx.array, cache: KVCache, mm: bool = False) -> None:
        """Append keys/values of verified context rows ``ctx`` (B, S, H) to ``cache``."""
        if ctx.shape[1] > 0:
            k_ctx, v_ctx = self.keys_values(ctx, cache.offset, mm)
            cache.update_and_fetch(k_ctx, v_ctx)

    def rows_mask(self, n_ctx: mx.array, n_keys: int, n_block: int) -> mx.array:
        """Boolean mask (B, 1, n_block, n_keys + n_block) when rows hold different context lengths.

        Row b's block sits at positions ``n_ctx[b] ..``; of the ``n_keys`` cached context keys it
        sees only its own first ``n_ctx[b]`` (then the window / causal rules as in
        :meth:`block_mask`), and all (or, causal, the earlier) keys of its own block.
        """
        q_pos = n_ctx[:, None, None] + mx.arange(n_block)[None, :, None]  # (B, L, 1)
        k_ctx = mx.arange(n_keys)[None, None, :]  # (1, 1, K)
        ctx_vis = k_ctx < n_ctx[:, None, None]  # (B, 1, K)
        blk = mx.arange(n_block)
        blk_vis = mx.ones((n_block, n_block), dtype=mx.bool_)
        if self.is_causal:
            blk_vis = blk_vis & (blk[None, :] <= blk[:, None])
        if self.sliding_window is not None:
            ctx_vis = ctx_vis & (q_pos - k_ctx < self.sliding_window)
            blk_vis = blk_vis & (blk[:, None] - blk[None, :] < self.sliding_window)
        B = n_ctx.shape[0]
        ctx_vis = mx.broadcast_to(ctx_vis, (B, n_block, n_keys))
        blk_vis = mx.broadcast_to(blk_vis, (B, n_block, n_block))
        return mx.concatenate([ctx_vis, blk_vis], axis=-1)[:, None]

    def _call_rows(self, x: mx.array, ctx: mx.array, cache: Any, fw: DraftPass | None) -> mx.array:
        # Per-row offsets (hf2q.runtime.slot_cache.SlotKVCache, host copy in ``lengths``): row
        # b's context keys sit at buffer positions [0, offset[b]); each row appends its own count
        # of ``ctx`` rows (``cache.prepare(lengths=...)``) and its block starts right after its
        # own context.
        L = x.shape[1]
        q, k_blk, v_blk = self.project(
            x, ctx, cache, fw is not None and fw.fuse, fw is not None and fw.mm
        )
        keys, values = cache.keys_and_values()
        n_ctx = cache.offset  # (B,)
        n_keys = 0 if keys is None else keys.shape[2]
        ks, vs = ([keys, k_blk], [values, v_blk]) if n_keys else ([k_blk], [v_blk])
        if cache.aligned:  # aligned rows: the single-sequence mask (often none)
            return self.attend(q, ks, vs, lambda: self.block_mask(n_keys, L, 0), fw)
        return self.attend(q, ks, vs, lambda: self.rows_mask(n_ctx, n_keys, L), fw)

    def __call__(
        self, x: mx.array, ctx: mx.array, cache: KVCache, fw: DraftPass | None = None
    ) -> mx.array:
        # x: (B, L, H) block rows; ctx: (B, S, H) new verified context rows (S may be 0).
        # fw: shared by the layers of one forward (masks, see attend; fuse, see project).
        if isinstance(cache.offset, mx.array):
            return self._call_rows(x, ctx, cache, fw)
        L = x.shape[1]
        q, k_blk, v_blk = self.project(
            x, ctx, cache, fw is not None and fw.fuse, fw is not None and fw.mm
        )
        keys, values = cache.keys_and_values() if cache.offset else (None, None)
        n_ctx = cache.offset
        first = 0
        if self.sliding_window is not None:
            # Keys older than the window are invisible to every block row: drop them early.
            first = max(0, n_ctx - (self.sliding_window - 1))
        if keys is not None and n_ctx > first:
            ks = [keys[..., first:n_ctx, :], k_blk]
            vs = [values[..., first:n_ctx, :], v_blk]
        else:
            ks, vs = [k_blk], [v_blk]
        return self.attend(q, ks, vs, lambda: self.block_mask(n_ctx - first, L, first), fw)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer: DFlash attention then a SwiGLU MLP, both with residuals."""

    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def fast_supported(self, x: mx.array, cache: Any) -> bool:
        """Whether :meth:`fast` can run this layer: a cache read in place (mlx-lm's ``KVCache``,
        hf2q's slot cache), half precision and head sizes the row attention kernel takes."""
        if not reads_buffer_in_place(cache) or x.dtype not in (mx.bfloat16, mx.float16):
            return False
        a = self.self_attn
        G = a.n_heads // a.n_kv_heads if a.n_heads % a.n_kv_heads == 0 else 0
        return a.head_dim % 32 == 0 and 1 <= G <= cuda_attention.MAX_GROUP

    def fast(self, x: mx.array, ctx: mx.array, cache: Any, mm: bool = False) -> mx.array:
        """The layer's inference forward with fewer graph nodes (same math as ``__call__``):
        compiled projections, norms and RoPE; the context rows' and then the block's keys and
        values written into the cache buffer (for one sequence both in one product and one
        write), the block attending over the buffer in place with
        :func:`hf2q.kernels.cuda_attention.row_attention_cuda` (no key concatenation, padding or
        mask), the block's entries dropped again (the cache keeps verified context only); a
        compiled output projection and MLP. ``mm``: products through the small-M kernel."""
        name = "_compiled_mm" if mm else "_compiled"
        hit = kept(self, name, _layer_weights(self), lambda: _CompiledLayer(self, mm))
        a = self.self_attn
        L = x.shape[1]
        if ctx.shape[1] > 0 and type(cache) is KVCache:
            # One sequence: context and block keys/values in one trace and one cache write.
            q, k, v = hit.joint(x, ctx, positions(cache.offset))
            cache.update_and_fetch(k, v)
            first = cache.offset - L
        else:
            if ctx.shape[1] > 0:  # slot rows: each row's context lands at its own length
                k, v = hit.context(ctx, positions(cache.offset))
                cache.update_and_fetch(k, v)
            elif hasattr(cache, "prepare"):
                cache.prepare(lengths=None)  # no context rows: the block write advances every row
            first = cache.offset  # the block's first position, per row (int or (B,))
            q, k, v = hit.block(x, positions(first))
            cache.update_and_fetch(k, v)
        o = cuda_attention.row_attention_cuda(
            q,
            cache.keys,
            cache.values,
            first,
            a.scale,
            window=a.sliding_window,
            causal=a.is_causal,
        )
        cache.trim(L)
        return hit.post(x, o)

    def __call__(
        self, x: mx.array, ctx: mx.array, cache: KVCache, fw: DraftPass | None = None
    ) -> mx.array:
        if fw is not None and fw.fast and self.fast_supported(x, cache):
            return self.fast(x, ctx, cache, fw.mm)
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache, fw)
        hn = self.post_attention_layernorm(h)
        mods = [self.mlp.gate_proj, self.mlp.up_proj]
        gate_up = _concatenated(self, "_gate_up", mods) if fw is not None and fw.fuse else None
        mm = fw is not None and fw.mm
        if gate_up is None:
            return h + swiglu_mlp(self.mlp, hn, mm)
        return h + mlp_fused(self.mlp, gate_up, hn, mm)


class DFlashDraftModel(nn.Module):
    """The drafter: ``fc`` + ``hidden_norm`` over concatenated target features, a layer stack, ``norm``.

    Parameter names equal z-lab's tensor names, so ``load_weights`` reads their safetensors as is.
    The target's embedding and lm_head are bound with :meth:`bind` and are not parameters here.
    """

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(
            len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False
        )
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DFlashDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._embed: Callable[[mx.array], mx.array] | None = None
        self._head: Callable[[mx.array], mx.array] | None = None
        self._vocab_ids: mx.array | None = None
        self._widen: Callable[[mx.array], mx.array] | None = None
        self._head_takes_mm = False

    def bind(
        self, embed: Callable[[mx.array], mx.array], head: Callable[[mx.array], mx.array]
    ) -> DFlashDraftModel:
        """Use the target's embedding (token ids -> hidden) and head (hidden -> logits)."""
        # Plain callables, not modules: the target's weights must not join this model's parameters.
        self._embed, self._head = embed, head
        # A draft vocabulary's head (TargetModel.draft_head) gives the logits of its ids only:
        # column j is token vocab_ids[j]; widen() puts them at the vocabulary's width.
        self._vocab_ids = getattr(head, "vocab_ids", None)
        self._widen = getattr(head, "widen", None)
        # A target's head takes ``mm`` (whether its product runs the small-M kernel): drafts of
        # many rows pass False (select.draft_mm_enabled); any other callable is called as is.
        try:
            self._head_takes_mm = "mm" in inspect.signature(head).parameters
        except (TypeError, ValueError):  # a callable without a signature (a builtin): as is
            self._head_takes_mm = False
        return self

    def proposals(self, logits: mx.array) -> mx.array:
        """Greedy drafts (int32 token ids) from this drafter's logits (..., columns): each
        position's argmax, mapped through a draft vocabulary's ids where the head has one
        (ascending ids: a tie goes to the lowest id, as the widened logits' argmax would)."""
        best = mx.argmax(logits, axis=-1).astype(mx.int32)
        return best if self._vocab_ids is None else mx.take(self._vocab_ids, best)

    def full_logits(self, logits: mx.array) -> mx.array:
        """This drafter's logits at the whole vocabulary's width (a draft vocabulary's widened
        with -inf outside its ids): what a sampled draft's probabilities are taken from."""
        return logits if self._widen is None else self._widen(logits)

    @property
    def is_bound(self) -> bool:
        """True once :meth:`bind` gave it the target's embedding and head."""
        return self._embed is not None and self._head is not None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def make_cache(self) -> list[KVCache]:
        """One KV cache per layer, holding keys/values of verified context positions only."""
        return [KVCache() for _ in self.layers]

    def context(self, features: mx.array, mm: bool = False) -> mx.array:
        """Project concatenated target features (B, S, n_ids*H) to drafter context rows (B, S, H)
        (``mm``: through the small-M kernel, see :class:`DraftPass`)."""
        return self.hidden_norm(linear(self.fc, features, mm))

    def add_context(self, features: mx.array, cache: list[KVCache]) -> None:
        """Append target features (B, S, n_ids*H) of S verified positions to the drafter cache
        without drafting (e.g. prompt chunks during prefill)."""
        mm = small_mm_enabled()
        ctx = self.context(features, mm)
        for layer, c in zip(self.layers, cache, strict=True):
            layer.self_attn.append_context(ctx, c, mm)

    def kernel_products(self, rows: int, head: bool = False) -> bool:
        """Whether a forward of ``rows`` block rows runs its layers' products (with ``head``: its
        head) through the small-M kernel (``select.draft_mm_enabled``, by the largest weight)."""
        cfg = self.config
        if head:
            return draft_mm_enabled(rows, cfg.vocab_size * cfg.hidden_size, head=True)
        widest = max(cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
        return draft_mm_enabled(rows, widest * cfg.hidden_size)

    @staticmethod
    def fast_enabled() -> bool:
        """Whether drafting runs :meth:`DFlashDecoderLayer.fast` where a layer allows it: on
        CUDA with the row attention kernel (``HF2Q_ROW_ATTENTION``) and ``HF2Q_COMPILE`` on."""
        return row_attention_enabled() and compile_enabled()

    def hidden(
        self,
        block: mx.array,
        features: mx.array,
        cache: list[KVCache],
        *,
        fast: bool | None = None,
        mm: bool | None = None,
    ) -> mx.array:
        """Final-normed hidden states (B, L, H) of the block rows.

        Args:
            block: (B, L) token ids ``[last_committed, MASK, ..., MASK]``.
            features: (B, S, n_ids*H) target features of the S newly verified positions; they are
                appended to ``cache`` and stay there (the cache holds verified context only).
            cache: from :meth:`make_cache`.
            fast: layers through :meth:`DFlashDecoderLayer.fast` where they allow it (None:
                :meth:`fast_enabled`).
            mm: products through the small-M kernel (None: :meth:`kernel_products`).
        """
        if self._embed is None:
            raise RuntimeError("DFlashDraftModel.bind(embed, head) must be called before drafting")
        h = self._embed(block)
        fw = DraftPass(
            fuse=fuse_proj_enabled(),
            bucket=sdpa_bucket(),
            mm=self.kernel_products(block.size) if mm is None else mm,
            fast=self.fast_enabled() if fast is None else fast,
        )
        ctx = self.context(features, fw.mm)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, ctx, c, fw)
        return self.norm(h)

    def __call__(
        self,
        block: mx.array,
        features: mx.array,
        cache: list[KVCache],
        graph: CompiledDraft | None = None,
    ) -> mx.array:
        """Draft logits (B, L-1, vocab; a draft vocabulary's ids only, see :meth:`proposals`)
        for block positions 1..L-1 (products through the small-M
        kernel up to ``select.draft_mm_rows()`` block rows, the head up to
        ``select.draft_head_mm_rows()``, MLX's matmul beyond); through ``graph`` (from
        :meth:`graph`) where it takes the block."""
        if graph is not None and graph.takes(block, features, cache):
            return graph(block, features, cache)
        h = self.hidden(block, features, cache, mm=self.kernel_products(block.size))[:, 1:]
        head_mm = self.head_mm(block.size)
        return self._head(h) if head_mm is None else self._head(h, mm=head_mm)

    def head_mm(self, rows: int) -> Frozen | None:
        """The ``mm`` a draft of ``rows`` block rows passes the target's head: :data:`FROZEN`
        (inference, the weight's transposed view kept) where the head takes ``mm`` and its
        product is off the small-M kernel, else None (the head's own default)."""
        if self._head_takes_mm and not self.kernel_products(rows, head=True):
            return FROZEN
        return None

    def graph(self, block_size: int) -> CompiledDraft | None:
        """A generation's drafts of full blocks (``block_size`` long) as one compiled graph each
        (:class:`hf2q.runtime.draft_graph.CompiledDraft`, ``HF2Q_COMPILE_DRAFT=1``), or None
        (off, or not bound to a target yet). Pass it to every call of the generation."""
        if not compile_draft_enabled() or not self.is_bound:
            return None
        return CompiledDraft(self, block_size)


def load_drafter_config(path: str | Path) -> DFlashConfig:
    """Read and validate ``path/config.json`` as a DFlash drafter config."""
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise DrafterError(
            f"{folder} has no config.json: pass a DFlash drafter folder or Hub repo id"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(
            f"{cfg_file} is not valid JSON ({exc.msg} at line {exc.lineno}): re-download or fix it"
        ) from exc
    return DFlashConfig.from_dict(cfg, where=f"drafter {folder}")


def load_drafter(path: str | Path, *, dtype: mx.Dtype | None = None) -> DFlashDraftModel:
    """Load a DFlash drafter from a local z-lab-format folder (quantized ones from hf2q too)."""
    folder = Path(path)
    cfg = load_drafter_config(folder)
    raw = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DrafterError(f"{folder} has no .safetensors weights: pass a complete drafter folder")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as exc:  # MLX raises RuntimeError/ValueError for damaged files
            raise DrafterError(
                f"{f} cannot be read ({exc}): re-download or re-convert the drafter"
            ) from exc
    model = DFlashDraftModel(cfg)
    quant = raw.get("quantization")
    if quant:
        nn.quantize(
            model,
            group_size=quant.get("group_size", 64),
            bits=quant.get("bits", 4),
            mode=quant.get("mode", "affine"),
            # Per-module settings (mixed-precision recipes) as mlx-lm records them.
            class_predicate=lambda p, m: (
                quant[p] if isinstance(quant.get(p), dict) else f"{p}.scales" in weights
            ),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise DrafterError(
            f"{folder}'s weights do not match its config.json ({exc}): the checkpoint is inconsistent"
        ) from exc
    if dtype is not None and not quant:
        model.set_dtype(dtype)
    model.eval()
    mx.eval(model.parameters())
    return model


def save_drafter(
    model: DFlashDraftModel, path: str | Path, *, extra_config: dict[str, Any] | None = None
) -> None:
    """Write ``model`` as a z-lab drafter: ``config.json`` + ``model.safetensors`` (no prefix)."""
    from mlx.utils import tree_flatten

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    if extra_config:
        cfg.update(extra_config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
