"""The target model: an mlx-lm causal LM viewed as embedding, decoder layers, final norm and head.

What it does: locate those parts in mlx-lm's own model classes (Qwen3.5 / Qwen3.6 dense and MoE,
multimodal wrapper or text-only, and plain Qwen3), and run a forward pass that drives mlx-lm's
decoder layers one by one so the outputs of chosen layers (the drafter's ``target_layer_ids``) can
be captured. Each layer's own ``__call__`` runs unchanged; nothing upstream is patched, and the
model stays usable by plain mlx-lm generation.

What it does not do: implement any layer, decide acceptance, or roll caches back (see the
caches module).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from hf2q.errors import ModelError
from hf2q.kernels import linear as small_mm
from hf2q.kernels.select import draft_head_mm_rows, small_mm_enabled

#: model_type values whose layer structure this adapter understands.
SUPPORTED_TARGET_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3")

#: A draft head's quantized copy is read only while its logits of 15 random rows are within this
#: share of the largest logit of the head's (4-bit copies: about 0.1; session 51 saw MLX's CUDA
#: product of a float32 4-bit copy give logits 100% off, about zero: see :func:`copy_group`).
COPY_TOLERANCE = 0.5


def copy_group(hidden: int) -> int:
    """The group size of a draft head's quantized copy for a hidden size ``hidden``: 64, or 32
    where ``hidden`` is not a multiple of 64 or is one group of 64. MLX's CUDA quantized product
    of more than one row is wrong where a row is a single group: on an H100 (session 54,
    ``benchmarks/qmm_check.py``, float32, 4 bits) K 64 in groups of 64 gave logits off by 100% of
    the largest at 15 and 60 rows (exact at one row), while K 64 in groups of 32 and K 128 or 2560
    in groups of 64 were exact. Session 55 (``qmm_check.py --one-group``) found K 64 in groups of
    64 wrong in every dtype and width tried (float32 8-bit, bf16 4- and 8-bit, float16 4-bit: off
    by 100% or NaN) and K 32 in groups of 32 right, so a hidden size of 32 keeps its one group.
    Real heads (hidden 1024 and up) take 64."""
    return 64 if hidden % 64 == 0 and hidden > 64 else 32


#: ``layer_fn(index, layer, h, mask, cache) -> h``: how one decoder layer is run (default: its own __call__).
LayerFn = Callable[[int, nn.Module, mx.array, Any, Any], mx.array]


def _run_layer(index: int, layer: nn.Module, h: mx.array, mask: Any, cache: Any) -> mx.array:
    return layer(h, mask=mask, cache=cache)


def _head_product(mod: nn.Module, tied: bool, h: mx.array, on: bool | small_mm.Frozen) -> mx.array:
    """Logits of ``h`` through a head module: a tied embedding's ``as_linear`` or a linear head."""
    return small_mm.head(mod, h, on) if tied else small_mm.linear(mod, h, on)


def _copy_product(
    q: nn.Module, tied: bool, h: mx.array, mm: bool | small_mm.Frozen | None
) -> mx.array:
    """A draft head's quantized copy ``q`` of ``h``. Drafts need no row invariance, so the faster
    product: on an H100 (session 49, quant_rows.py, the 248320 x 2560 head, us at 15 rows) 8-bit
    MLX 334, hf2q's kernel 414; 4-bit MLX 307, the kernel 280. So 8-bit copies take MLX's
    product, 4-bit ones the kernel where it runs (CUDA, bf16 / fp16) and the draft's rows take
    it. MLX's product goes through FROZEN: all rows as one product (a 3-D input would be a
    batched GEMM, a pass over the copy a slot)."""
    on = small_mm_enabled() if mm is None else mm
    if q.bits == 8 or not (on and small_mm.quantized_fits(q, h)):
        on = small_mm.FROZEN
    return _head_product(q, tied, h, on)


class TargetModel:
    """A loaded mlx-lm model plus the handles DFlash needs; see the module docstring."""

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        lm = getattr(model, "language_model", model)
        inner = getattr(lm, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "layers"):
            raise ModelError(
                f"{type(model).__module__} models are not supported as DFlash targets "
                f"(supported model types: {', '.join(SUPPORTED_TARGET_TYPES)})"
            )
        self.lm = lm
        self.inner = inner
        self.args = lm.args
        self.model_type = getattr(model, "model_type", getattr(self.args, "model_type", ""))
        # Read on every layer of every forward: asked of the modules once.
        self._linear = tuple(bool(getattr(x, "is_linear", False)) for x in inner.layers)
        # draft_head's functions by bits (their quantized copies are kept on the head's module)
        self._draft_head_fns: dict[tuple[int, int], Callable[..., mx.array]] = {}
        #: (bits, vocab) -> why that draft head's quantized copy is not read (see _copy_agrees)
        self.draft_head_notes: dict[tuple[int, int], str] = {}

    # -- sizes -----------------------------------------------------------------------------
    @property
    def layers(self) -> list[nn.Module]:
        return self.inner.layers

    @property
    def num_layers(self) -> int:
        return len(self.inner.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.args.hidden_size)

    @functools.cached_property
    def gdn_state_size(self) -> int:
        """Elements of one Gated-DeltaNet layer's recurrent state for one sequence (value heads x
        value dim x key dim; 0 for a model without such layers)."""
        for i, layer in enumerate(self.inner.layers):
            if self._linear[i]:
                a = layer.linear_attn
                return int(a.num_v_heads * a.head_v_dim * a.head_k_dim)
        return 0

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the target computes in: its embedding's (its scales' when quantized)."""
        emb = self.inner.embed_tokens
        scales = getattr(emb, "scales", None)
        return (scales if scales is not None else emb.weight).dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding (what drafter token ids and the mask id index into)."""
        emb = self.inner.embed_tokens
        w = emb.weight
        # Quantized embeddings pack several values per uint32; the row count is still shape[0].
        return int(w.shape[0])

    def is_linear(self, index: int) -> bool:
        """True for Gated-DeltaNet (linear attention) layers, False for full attention."""
        return self._linear[index]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_linear(i)]

    # -- pieces ----------------------------------------------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        """Token ids (B, L) -> input hidden states (B, L, H)."""
        return self.inner.embed_tokens(tokens)

    def head(self, h: mx.array, mm: bool | small_mm.Frozen | None = None) -> mx.array:
        """Final-normed hidden states (B, L, H) -> logits (B, L, vocab).

        ``mm``: the product through hf2q's small-M kernel where it fits, as the compiled layer
        runners' products (None: ``select.small_mm_enabled()``, on CUDA); ``small_mm.FROZEN``:
        MLX's matmul with the weight's transposed view made once (inference only).
        """
        mod, tied = self._head_module()
        return _head_product(mod, tied, h, small_mm_enabled() if mm is None else mm)

    def draft_head(self, bits: int | None = None, vocab: int = 0) -> Callable[..., mx.array]:
        """The head a drafter binds: :meth:`head` itself, or with ``bits`` 4 or 8 the product of
        a copy of the head's weight quantized (MLX's affine layout, groups of :func:`copy_group`),
        or with ``vocab`` > 0 the product of the head's rows of :meth:`draft_vocab_ids` only
        (quantized too with ``bits``).

        Drafts only propose: the verify and every token still come from :meth:`head`, so greedy
        output stays plain decoding's and sampled output the target's distribution (rejection
        sampling takes the draft's probabilities whatever they are). The copy reads a quarter
        (4-bit) or half (8-bit) of a bf16 head's bytes a draft; it may propose other tokens where
        two are close, which changes only how many are accepted. Drafts of more rows than
        ``select.draft_head_mm_rows()`` (32; four slots' 60) read the head itself, whose product
        was faster than the copies' there on an H100. A head that is already quantized (a
        quantized target) is used as it is. The copy is made here, once a bit width, and made
        again by :meth:`refresh_draft_heads` when the target's weights are cast.

        A draft vocabulary (``vocab``: FR-Spec's frequency-ranked draft vocabulary, Zhao et al.
        2025) reads ``vocab / vocab_size`` of the head's bytes: Qwen3.5's head is 248320 rows,
        1.27 GB in bf16 at hidden 2560, the largest product of a draft. Its function gives the
        logits of its ids only (column j: token ``vocab_ids[j]``, an attribute of the function)
        and ``widen(logits)`` (another attribute) puts them at the full vocabulary's width with
        -inf outside the ids. A greedy draft maps its argmax through ``vocab_ids``
        (:meth:`DFlashDraftModel.proposals`), never widening: on an H100 the widening's gather
        of 15 rows took 250 us against 165 for the 32768 rows' product (session 52). A sampled
        draft widens, so its probabilities outside the ids are 0 (rejection sampling stays
        exact). A target token outside the ids is never accepted from a draft but still
        committed as the round's own.
        """
        bits, vocab = bits or 0, vocab or 0
        if bits not in (0, 4, 8):
            raise ModelError(f"a draft head is quantized to 4 or 8 bits, not {bits}: pass 4 or 8")
        if vocab < 0:
            raise ModelError(
                f"a draft vocabulary is a positive token count, not {vocab}: pass 0 for the whole one"
            )
        mod, _ = self._head_module()
        ids = self.draft_vocab_ids(vocab) if vocab else None
        if ids is not None and len(ids) >= int(mod.weight.shape[0]):
            ids, vocab = None, 0  # rounded up to every row: the head's own rows
        if type(mod) not in (nn.Embedding, nn.Linear):
            bits = 0  # a quantized head (a quantized target): its rows as they are
        if not bits and not vocab:
            return self.head
        if bits:
            self._check_quantizable()
        if (bits, vocab) not in self._draft_head_fns:
            self._draft_head_fns[(bits, vocab)] = self._draft_fn(bits, vocab, ids)
        return self._draft_head_fns[(bits, vocab)]

    def _draft_fn(self, bits: int, vocab: int, ids: list[int] | None) -> Callable[..., mx.array]:
        """:meth:`draft_head`'s function for ``bits`` and ``vocab`` (the ids ``ids``). Its copy
        and rows are made (and the copy checked) here: a compiled draft's trace cannot evaluate
        them."""
        mod, tied = self._head_module()
        tied = tied and not vocab  # a vocabulary's rows are a linear layer
        if ids is not None:
            self._vocab_rows(vocab)
        if bits:
            self._copy_agrees(bits, vocab)

        def head(h: mx.array, mm: bool | small_mm.Frozen | None = None) -> mx.array:
            # The copy up to select.draft_head_mm_rows() rows (32: one or two slots' drafts),
            # the rows themselves beyond: on an H100 four slots' rounds of the 4B-shaped pair (60
            # head rows) took 8.742 ms with the bf16 head (cuBLAS), 8.807 with the 8-bit copy and
            # 8.950 with the 4-bit one, one slot's 6.233 / 6.130 / 6.092 (session 50,
            # plain_ab.py; quant_rows.py at 60 rows: 4-bit MLX 659 us, hf2q's kernel 717, bf16
            # cuBLAS 546 in session 49).
            rows_ok = h.size // h.shape[-1] <= draft_head_mm_rows()
            if bits and rows_ok and self._copy_agrees(bits, vocab):
                return _copy_product(self._copy(bits, vocab), tied, h, mm)
            if ids is None:
                return self.head(h, mm)
            rows = self._vocab_rows(vocab)
            on = small_mm_enabled() if mm is None else mm
            if type(rows) is not nn.Linear and not (on and small_mm.quantized_fits(rows, h)):
                on = small_mm.FROZEN  # all rows as one product, not a batched GEMM a slot
            return small_mm.linear(rows, h, on)

        if ids is not None:  # token t <- logit index[t] of the rows; the last column -inf
            columns = np.full(int(mod.weight.shape[0]), len(ids), dtype=np.int32)
            columns[ids] = np.arange(len(ids), dtype=np.int32)
            index = mx.array(columns)

            def widened(y: mx.array) -> mx.array:
                # -inf outside the ids: probability 0 in a sampled draft's softmax
                fill = mx.full((*y.shape[:-1], 1), -mx.inf, dtype=y.dtype)
                return mx.take(mx.concatenate([y, fill], axis=-1), index, axis=-1)

            head.vocab_ids = mx.array(ids, dtype=mx.int32)  # type: ignore[attr-defined]
            head.widen = widened  # type: ignore[attr-defined]
        return head

    def _copy(self, bits: int, vocab: int) -> nn.Module:
        """The ``bits``-bit copy a draft head reads: of the vocabulary's rows, or of the head."""
        return self._vocab_rows(vocab, bits) if vocab else self._quantized_head(bits)

    def _check_quantizable(self) -> None:
        if self.hidden_size % 32:
            raise ModelError(
                f"a quantized draft head needs a hidden size that is a multiple of 32, this "
                f"target's is {self.hidden_size}: drop --draft-head-bits"
            )

    def draft_vocab_ids(self, vocab: int) -> list[int]:
        """The token ids a draft vocabulary of ``vocab`` proposes: the ``vocab`` lowest ids, the
        tokenizer's added (special) tokens and stop tokens, then more of the lowest ids up to a
        multiple of 128 rows (what hf2q's product kernels take whole). Byte-level BPE
        vocabularies (Qwen's) number their tokens in merge order, most frequent pieces first,
        so the lowest ids stand in for FR-Spec's corpus counts."""
        rows = int(self._head_module()[0].weight.shape[0])
        extra: set[int] = set()
        tok = self.tokenizer
        if tok is not None:
            inner = getattr(tok, "_tokenizer", tok)
            added = getattr(inner, "get_added_vocab", None)
            extra.update(int(i) for i in (added() if added else {}).values())
            extra.update(int(i) for i in getattr(tok, "eos_token_ids", None) or ())
            eos = getattr(inner, "eos_token_id", None)
            if isinstance(eos, int):
                extra.add(eos)
        extra = {i for i in extra if vocab <= i < rows}
        n = min(rows, -(-(vocab + len(extra)) // 128) * 128)
        low = itertools.islice((i for i in range(rows) if i not in extra), n - len(extra))
        return sorted([*low, *extra])

    def _vocab_rows(self, vocab: int, bits: int = 0) -> nn.Module:
        """The head's rows of ``draft_vocab_ids(vocab)`` as a linear layer without bias (a
        quantized head's rows stay quantized), or with ``bits`` a quantized copy of them; kept
        on the head's module with the weights it copies (``small_mm.kept``)."""
        mod, _ = self._head_module()

        def build() -> nn.Module:
            ids = mx.array(self.draft_vocab_ids(vocab))
            if bits:
                q = nn.QuantizedLinear.from_linear(
                    self._vocab_rows(vocab), group_size=copy_group(self.hidden_size), bits=bits
                )
                mx.eval(q.parameters())
                return q
            if type(mod) in (nn.Embedding, nn.Linear):
                rows = nn.Linear(self.hidden_size, len(ids), bias="bias" in mod)
                rows.weight = mod.weight[ids]
            else:
                kind = dict(group_size=mod.group_size, bits=mod.bits, mode=mod.mode)
                rows = nn.QuantizedLinear(self.hidden_size, len(ids), bias="bias" in mod, **kind)
                rows.weight, rows.scales = mod.weight[ids], mod.scales[ids]
                if mod.get("biases") is not None:
                    rows.biases = mod.biases[ids]
            if "bias" in mod:
                rows.bias = mod.bias[ids]
            mx.eval(rows.parameters())
            return rows

        return small_mm.kept(mod, f"_hf2q_draft_vocab_{vocab}_{bits}", self._head_sources(), build)

    def refresh_draft_heads(self) -> None:
        """Make :meth:`draft_head`'s copies again where the head's weight was replaced (a dtype
        cast), before any draft reads them."""
        for bits, vocab in self._draft_head_fns:
            if vocab:
                self._vocab_rows(vocab)
            if bits:
                self._copy_agrees(bits, vocab)

    def _copy_agrees(self, bits: int, vocab: int = 0) -> bool:
        """Whether :meth:`draft_head`'s ``bits``-bit copy (of the draft vocabulary's rows with
        ``vocab``) gives, for 15 random rows in its dtype and through the product a draft takes,
        logits within :data:`COPY_TOLERANCE` of the largest of the full-precision rows'. Checked
        once a copy (kept with it); where not, the draft reads the rows themselves and
        :attr:`draft_head_notes` says why. Session 51: MLX's quantized product of the fitted test
        pair's float32 4-bit copy on an H100 gave logits about zero."""
        mod, tied = self._head_module()

        def build() -> bool:
            copy, tied_copy = self._copy(bits, vocab), tied and not vocab
            ref = self._vocab_rows(vocab) if vocab else mod
            h = mx.random.normal((1, 15, self.hidden_size), key=mx.random.key(0))
            h = h.astype(copy.scales.dtype)
            got = _copy_product(copy, tied_copy, h, None).astype(mx.float32)
            want = _head_product(ref, tied_copy, h, small_mm.FROZEN).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30)).item()
            if err < COPY_TOLERANCE:
                self.draft_head_notes.pop((bits, vocab), None)
                return True
            self.draft_head_notes[(bits, vocab)] = (
                f"the draft head's {bits}-bit copy gave logits {err:.0%} of the largest off the "
                f"head's on {mx.default_device()} ({h.dtype}): drafts read the unquantized rows; drop "
                f"--draft-head-bits or pick another --dtype"
            )
            return False

        return small_mm.kept(mod, f"_hf2q_draft_check_{vocab}_{bits}", self._head_sources(), build)

    def _head_sources(self) -> list[mx.array]:
        """The head's arrays its draft copies and rows are made from (``small_mm.kept``)."""
        mod, _ = self._head_module()
        return [mod.weight] + ([mod.scales] if hasattr(mod, "scales") else [])

    def _head_module(self) -> tuple[nn.Module, bool]:
        """(the head's module, whether it is the tied embedding)."""
        tied = getattr(self.args, "tie_word_embeddings", False) or not hasattr(self.lm, "lm_head")
        return (self.inner.embed_tokens if tied else self.lm.lm_head), tied

    def _quantized_head(self, bits: int) -> nn.Module:
        """The head's ``bits``-bit copy, kept on the head's module with the weight it copies
        (``small_mm.kept``: made again when that weight is replaced)."""
        mod, tied = self._head_module()
        group = copy_group(self.hidden_size)

        def build() -> nn.Module:
            if tied:
                q = nn.QuantizedEmbedding.from_embedding(mod, group_size=group, bits=bits)
            else:
                q = nn.QuantizedLinear.from_linear(mod, group_size=group, bits=bits)
            mx.eval(q.parameters())
            return q

        return small_mm.kept(mod, f"_hf2q_draft_head_{bits}", [mod.weight], build)

    def logits(self, h: mx.array, mm: bool | None = None) -> mx.array:
        """Last-layer hidden states -> logits (final norm, then head; ``mm`` as in :meth:`head`)."""
        return self.head(self.inner.norm(h), mm)

    def make_cache(self) -> list[Any]:
        """mlx-lm's own cache list for this model (KVCache / ArraysCache per layer)."""
        from mlx_lm.models.cache import make_prompt_cache

        # Qwen3 has no make_cache(); make_prompt_cache falls back to one KVCache per layer.
        return make_prompt_cache(self.model)

    def masks(self, h: mx.array, cache: Sequence[Any] | None) -> tuple[Any, Any]:
        """(full-attention mask, linear-attention mask) for input ``h``, as mlx-lm builds them."""
        fa_mask = ssm_mask = None
        for i in range(self.num_layers):
            c = cache[i] if cache is not None else None
            if self.is_linear(i):
                if ssm_mask is None:
                    ssm_mask = create_ssm_mask(h, c)
            elif fa_mask is None:
                fa_mask = create_attention_mask(h, c)
        return fa_mask, ssm_mask

    def forward(
        self,
        tokens: mx.array,
        cache: Sequence[Any] | None = None,
        *,
        capture: Sequence[int] = (),
        layer_fn: LayerFn | None = None,
        last_only: bool = False,
        mm: bool | None = None,
        flush_every: int = 0,
    ) -> tuple[mx.array, mx.array | None]:
        """Run the target on ``tokens`` (B, L), updating ``cache`` in place.

        Args:
            capture: decoder layer indices whose outputs (after the layer's residual adds, before
                the final norm) are returned concatenated on the feature axis, in this order.
            layer_fn: runs one layer; defaults to the layer's own ``__call__``. The verify path
                passes one that records what exact rollback needs.
            last_only: return logits of the last position only (prefill).
            mm: the head's product through the small-M kernel (:meth:`head`); None: as hf2q's
                paths do (``select.small_mm_enabled()``) when a ``layer_fn`` is given, and
                mlx-lm's own product without one (the model's own calls stay stock).
            flush_every: queue the graph built so far (``mx.async_eval``) after every this many
                layers, so the device starts on them while the rest is built (0: never; the
                values are the same either way).

        Returns:
            ``(logits, features)``: logits (B, L or 1, vocab); features (B, L, len(capture)*H) or
            None when nothing is captured.
        """
        run = layer_fn or _run_layer
        h = self.embed(tokens)
        fa_mask, ssm_mask = self.masks(h, cache)
        want = {lid: k for k, lid in enumerate(capture)}
        captured: list[mx.array | None] = [None] * len(capture)
        n = len(self.inner.layers)
        for i, layer in enumerate(self.inner.layers):
            c = cache[i] if cache is not None else None
            h = run(i, layer, h, ssm_mask if self.is_linear(i) else fa_mask, c)
            if i in want:
                captured[want[i]] = h
            if flush_every and (i + 1) % flush_every == 0 and i + 1 < n:
                mx.async_eval(h)
        if last_only:
            h = h[:, -1:]
        features = mx.concatenate(captured, axis=-1) if capture else None
        return self.logits(h, False if layer_fn is None and mm is None else mm), features
