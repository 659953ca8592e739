"""Quality check of a conversion: the quantized model's next-token distribution against the float one.

What it does: tokenize a short built-in text, then run the unquantized model (the same conversion
with quantization off) and the converted model side by side, one decoder layer at a time: each
layer's float weights are read from the source, run, then the same mlx-lm layer instance is
quantized in place, loaded with the written weights and run on its own input stream. Embedding
rows are gathered for the text's tokens only and the output head is applied in vocabulary chunks,
so memory stays near one layer plus a chunk of the head, whatever the model size. Reports the
mean and max KL divergence KL(float || quantized) over the text's positions and the share of
positions whose top-1 token agrees.

What it does not do: generate text, or evaluate drafters (a drafter needs its target; its weights'
reconstruction error is measured while writing instead, see ``hf2q.convert.quantize``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf2q.convert.plan import Input, Plan, build_plan
from hf2q.convert.safetensors_io import TensorInfo, read_header, read_rows, read_tensor

#: The built-in text: plain prose plus a little code, as a chat model sees both.
EVAL_TEXT = (
    "The river rose quickly after three days of rain, and the old bridge groaned under the "
    "weight of the water. In the village, people carried their belongings to higher ground.\n"
    "def mean(values):\n    total = sum(values)\n    return total / len(values)\n"
    "Question: what is the capital of France? Answer: Paris is the capital of France."
)

#: Vocabulary rows of the head evaluated at a time.
HEAD_CHUNK_ROWS = 16384


@dataclass
class EvalResult:
    """Next-token agreement of the converted model with the unquantized one."""

    tokens: int
    kl_mean: float
    kl_max: float
    top1_agreement: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top1_agreement": self.top1_agreement,
        }


class _Written:
    """Tensors of the written output, read from its shards by name."""

    def __init__(self, folder: Path) -> None:
        self.infos: dict[str, TensorInfo] = {}
        for f in sorted(folder.glob("model*.safetensors")):
            self.infos.update(read_header(f)[0])

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def tensor(self, name: str) -> Any:
        return read_tensor(self.infos[name])

    def rows(self, name: str, start: int, stop: int) -> Any:
        return read_rows(self.infos[name], start, stop)


def _input_tensor(inp: Input, out_dtype: Any) -> Any:
    """The whole (float) reference tensor of a planned input, cast like the conversion casts it."""
    x = read_tensor(inp.info) if inp.info is not None else inp.array
    if out_dtype is not None and x.dtype != out_dtype:
        x = x.astype(out_dtype)
    return x


def _input_rows(inp: Input, start: int, stop: int, out_dtype: Any) -> Any:
    if inp.info is not None:
        x = read_rows(inp.info, start, stop)
    else:
        x = inp.array[start:stop]
    if out_dtype is not None and x.dtype != out_dtype:
        x = x.astype(out_dtype)
    return x


def evaluate(plan: Plan, output: Path, tokenizer: Any, *, max_tokens: int = 64) -> EvalResult:
    """Compare the converted target in ``output`` with its unquantized counterpart on EVAL_TEXT.

    Args:
        plan: the plan the output was written from (for the quantized modules' settings).
        output: folder holding the written shards.
        tokenizer: anything with ``encode(text) -> list[int]``.
        max_tokens: positions compared (the text is cut to this many tokens).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    from hf2q.runtime.target import TargetModel

    ids = list(tokenizer.encode(EVAL_TEXT))[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the evaluation text tokenized to fewer than 2 tokens")
    # The reference: the same checkpoint planned without quantization, cast to the same dtype.
    ref = build_plan(plan.folder, policy_default=None, dtype=plan.out_dtype, keep_mtp=False)
    ref_inputs = {j.name: (j.input, j.out_dtype) for j in ref.jobs}
    specs = {j.module: j.spec for j in plan.jobs if j.spec is not None}
    written = _Written(output)
    target = TargetModel(ref.model)
    inner_path = next(p for p, m in ref.model.named_modules() if m is target.inner)
    prefix = f"{inner_path}." if inner_path else ""
    tied = bool(getattr(target.args, "tie_word_embeddings", False)) or not hasattr(
        target.lm, "lm_head"
    )
    lm_path = next((p for p, m in ref.model.named_modules() if m is target.lm), "")
    head = f"{prefix}embed_tokens" if tied else (f"{lm_path}.lm_head" if lm_path else "lm_head")
    embed = f"{prefix}embed_tokens"

    def ref_param(name: str) -> Any:
        inp, dt = ref_inputs[name]
        return _input_tensor(inp, dt)

    # Embedding rows of the text's tokens only.
    uniq = sorted(set(ids))
    pos = {t: i for i, t in enumerate(uniq)}
    gather = mx.array([pos[t] for t in ids])
    inp, dt = ref_inputs[f"{embed}.weight"]
    h_ref = mx.concatenate([_input_rows(inp, t, t + 1, dt) for t in uniq])[gather][None]
    h_q = mx.concatenate([_q_rows(written, embed, specs.get(embed), t, t + 1) for t in uniq])[
        gather
    ][None]
    mx.eval(h_ref, h_q)

    fa_mask, ssm_mask = target.masks(h_ref, None)
    for i, layer in enumerate(target.layers):
        p = f"{prefix}layers.{i}."
        names = [n for n in ref_inputs if n.startswith(p)]
        weights = [(n[len(p) :], ref_param(n)) for n in names]
        mx.eval([w for _, w in weights])
        layer.load_weights(weights, strict=True)
        mask = ssm_mask if target.is_linear(i) else fa_mask
        h_ref = layer(h_ref, mask=mask, cache=None)
        mx.eval(h_ref)

        def predicate(path: str, module: Any, _p: str = p) -> Any:
            spec = specs.get(_p + path)
            return spec.as_dict() if spec is not None else False

        nn.quantize(layer, class_predicate=predicate)
        q_names = sorted(set(n for n in written.infos if n.startswith(p)))
        layer.load_weights([(n[len(p) :], written.tensor(n)) for n in q_names], strict=True)
        h_q = layer(h_q, mask=mask, cache=None)
        mx.eval(h_q)
        # Done with this layer: drop its weights before the next one is read.
        layer.update(tree_map(lambda _: mx.zeros((0,)), layer.parameters()))
        for n in names:
            ref_inputs[n][0].array = None

    norm = target.inner.norm
    norm.load_weights([("weight", ref_param(f"{prefix}norm.weight"))], strict=True)
    h_ref = norm(h_ref)[0]
    norm.load_weights([("weight", written.tensor(f"{prefix}norm.weight"))], strict=True)
    h_q = norm(h_q)[0]
    mx.eval(h_ref, h_q)

    vocab = ref_inputs[f"{head}.weight"][0].shape[0]
    ref_logits, q_logits = [], []
    inp, dt = ref_inputs[f"{head}.weight"]
    for r0 in range(0, vocab, HEAD_CHUNK_ROWS):
        r1 = min(vocab, r0 + HEAD_CHUNK_ROWS)
        w = _input_rows(inp, r0, r1, dt)
        ref_logits.append((h_ref @ w.T).astype(mx.float32))
        q_logits.append(_q_matmul(written, head, specs.get(head), h_q, r0, r1).astype(mx.float32))
        mx.eval(ref_logits[-1], q_logits[-1])
    lr = nn.log_softmax(mx.concatenate(ref_logits, axis=-1), axis=-1)  # (T, vocab)
    lq = nn.log_softmax(mx.concatenate(q_logits, axis=-1), axis=-1)
    kl = mx.sum(mx.exp(lr) * (lr - lq), axis=-1)  # (T,)
    agree = mx.mean((mx.argmax(lr, axis=-1) == mx.argmax(lq, axis=-1)).astype(mx.float32))
    mx.eval(kl, agree)
    kl_list = [max(0.0, float(v)) for v in kl.tolist()]
    return EvalResult(
        tokens=len(ids),
        kl_mean=sum(kl_list) / len(kl_list),
        kl_max=max(kl_list),
        top1_agreement=float(agree.item()),
    )


def _q_rows(written: _Written, module: str, spec: Any, start: int, stop: int) -> Any:
    """Rows of a written (maybe quantized) embedding-like weight, dequantized."""
    import mlx.core as mx

    w = written.rows(f"{module}.weight", start, stop)
    if spec is None:
        return w
    scales = written.rows(f"{module}.scales", start, stop)
    biases = written.rows(f"{module}.biases", start, stop) if spec.mode == "affine" else None
    # As mlx-lm's QuantizedEmbedding does it: dequantize the gathered rows.
    return mx.dequantize(
        w, scales, biases, group_size=spec.group_size, bits=spec.bits, mode=spec.mode
    )


def _q_matmul(written: _Written, module: str, spec: Any, h: Any, start: int, stop: int) -> Any:
    """``h @ W[start:stop].T`` with the written head weight, quantized as mlx-lm would run it."""
    import mlx.core as mx

    w = written.rows(f"{module}.weight", start, stop)
    if spec is None:
        return h @ w.T
    scales = written.rows(f"{module}.scales", start, stop)
    biases = written.rows(f"{module}.biases", start, stop) if spec.mode == "affine" else None
    return mx.quantized_matmul(
        h,
        w,
        scales,
        biases,
        transpose=True,
        group_size=spec.group_size,
        bits=spec.bits,
        mode=spec.mode,
    )
