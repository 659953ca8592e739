"""Quality check of a conversion: the quantized model's next-token distribution against the float one.

What it does: tokenize a short built-in text, then run the unquantized model (the same conversion
with quantization off) and the converted model side by side, one decoder layer at a time: each
layer's float weights are read from the source and run, then the same mlx-lm layer instance is
loaded with the written weights, dequantized (exactly the values a quantized layer multiplies by,
in the float model's dtype: plain matmuls, which MLX's CPU backend runs far faster than its
quantized ones), and run on its own input stream. Embedding
rows are gathered for the text's tokens only and the output head is applied in vocabulary chunks,
so memory stays near one layer plus a chunk of the head, whatever the model size. Reports the
mean and max KL divergence KL(float || quantized) over the text's positions and the share of
positions whose top-1 token agrees.

What it does not do: generate text, or evaluate drafters (a drafter needs its target; its weights'
reconstruction error is measured while writing instead, see ``hf2q.convert.workers``).
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

#: Bytes of the output head read at a time.
HEAD_CHUNK_BYTES = 16 << 20


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


def eval_tokens(params: int, *, max_tokens: int = 64, flop_budget: float | None = None) -> int:
    """Positions to compare: ``max_tokens``, fewer when a forward pass would exceed the budget.

    A forward pass costs about ``2 * params`` FLOPs per token and the check runs two (float and
    quantized). On MLX's CPU backend a billion-parameter model runs at a few GFLOP/s, so the
    check is sized to stay in proportion with the conversion; never fewer than 8 positions.
    """
    if flop_budget is None:
        return max_tokens
    return max(8, min(max_tokens, int(flop_budget // max(1, 2 * params))))


def evaluate(plan: Plan, output: Path, tokenizer: Any, *, max_tokens: int = 64) -> EvalResult:
    """Compare the converted target in ``output`` with its unquantized counterpart on EVAL_TEXT.

    The converted model runs with its written weights dequantized (exactly the values
    ``QuantizedLinear`` multiplies by) in the float model's dtype, through the same mlx-lm layer
    instances as the float model, so the two differ only by quantization.

    Args:
        plan: the plan the output was written from (for the quantized modules' settings).
        output: folder holding the written shards.
        tokenizer: anything with ``encode(text) -> list[int]``.
        max_tokens: positions compared (the text is cut to this many tokens).
    """
    import mlx.core as mx

    ids = list(tokenizer.encode(EVAL_TEXT))[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the evaluation text tokenized to fewer than 2 tokens")
    old_limit = mx.set_cache_limit(64 << 20)  # one layer at a time: keep freed buffers few
    try:
        return _evaluate(plan, output, ids)
    finally:
        mx.set_cache_limit(old_limit)
        mx.clear_cache()


def _evaluate(plan: Plan, output: Path, ids: list[int]) -> EvalResult:
    import mlx.core as mx
    import mlx.nn as nn

    from hf2q.runtime.target import TargetModel

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

    def dtype_of(name: str) -> Any:
        inp, dt = ref_inputs[name]
        return dt if dt is not None else inp.dtype

    def q_param(name: str) -> Any:
        module, _, leaf = name.rpartition(".")
        spec = specs.get(module)
        if leaf == "weight" and spec is not None:
            return _dequantize(written, module, spec, dtype_of(name))
        return written.tensor(name)

    # Embedding rows of the text's tokens only.
    uniq = sorted(set(ids))
    pos = {t: i for i, t in enumerate(uniq)}
    gather = mx.array([pos[t] for t in ids])
    inp, dt = ref_inputs[f"{embed}.weight"]
    edt = dtype_of(f"{embed}.weight")
    h_ref = mx.concatenate([_input_rows(inp, t, t + 1, dt) for t in uniq])[gather][None]
    h_q = mx.concatenate(
        [_dequantize(written, embed, specs.get(embed), edt, t, t + 1) for t in uniq]
    )[gather][None]
    mx.eval(h_ref, h_q)

    fa_mask, ssm_mask = target.masks(h_ref, None)
    for i, layer in enumerate(target.layers):
        p = f"{prefix}layers.{i}."
        names = [n for n in ref_inputs if n.startswith(p)]
        mask = ssm_mask if target.is_linear(i) else fa_mask
        # The module's own (lazy, never evaluated) initial parameters: putting them back frees
        # the loaded weights and keeps the shapes that strict loading checks.
        template = layer.parameters()
        for source, stream in ((ref_param, "ref"), (q_param, "q")):
            weights = []
            for n in names:  # one tensor at a time: no pile-up of read / dequantize buffers
                w = source(n)
                mx.eval(w)
                weights.append((n[len(p) :], w))
            layer.load_weights(weights, strict=True)
            del weights, w
            if stream == "ref":
                h_ref = layer(h_ref, mask=mask, cache=None)
                mx.eval(h_ref)
            else:
                h_q = layer(h_q, mask=mask, cache=None)
                mx.eval(h_q)
            # Drop this stream's weights before the next ones are read.
            layer.update(template)
            mx.clear_cache()
        for n in names:
            ref_inputs[n][0].array = None
        mx.clear_cache()

    norm = target.inner.norm
    norm.load_weights([("weight", ref_param(f"{prefix}norm.weight"))], strict=True)
    h_ref = norm(h_ref)[0]
    norm.load_weights([("weight", written.tensor(f"{prefix}norm.weight"))], strict=True)
    h_q = norm(h_q)[0]
    mx.eval(h_ref, h_q)

    vocab = ref_inputs[f"{head}.weight"][0].shape[0]
    ref_logits, q_logits = [], []
    inp, dt = ref_inputs[f"{head}.weight"]
    hdt = dtype_of(f"{head}.weight")
    step = max(1, HEAD_CHUNK_BYTES // max(1, inp.nbytes // vocab))
    for r0 in range(0, vocab, step):
        r1 = min(vocab, r0 + step)
        w = _input_rows(inp, r0, r1, dt)
        wq = _dequantize(written, head, specs.get(head), hdt, r0, r1)
        ref_logits.append((h_ref @ w.T).astype(mx.float32))
        q_logits.append((h_q @ wq.T).astype(mx.float32))
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


def _dequantize(
    written: _Written,
    module: str,
    spec: Any,
    dtype: Any,
    start: int | None = None,
    stop: int | None = None,
) -> Any:
    """A written weight (all rows, or rows ``[start, stop)``), dequantized to ``dtype``."""
    import mlx.core as mx

    def part(suffix: str) -> Any:
        name = f"{module}.{suffix}"
        return written.tensor(name) if start is None else written.rows(name, start, stop)

    w = part("weight")
    if spec is None:
        return w
    biases = part("biases") if spec.mode == "affine" else None
    return mx.dequantize(
        w,
        part("scales"),
        biases,
        group_size=spec.group_size,
        bits=spec.bits,
        mode=spec.mode,
        dtype=dtype,
    )
