"""bf16 DFlash equals bf16 plain decoding exactly (the embedded demo pair, native dtype).

In float32 a verify row and the decode step of the same token agree to rounding and the tokens
are equal (test_runtime_fidelity.py). In bf16 one rounding difference can flip a near-tie, so
losslessness in bf16 needs every row of a verify block computed with the same bits as plain
decoding's step. On MLX's CPU backend it is (checked here layer by layer). On MLX's CUDA backend
hf2q's own products (hf2q/kernels/cuda_matmul.py) and attention (cuda_attention.py) make it so:
MLX's own matmul and attention round a 16-row block differently from one row
(`benchmarks/row_invariance.py`; docs/BENCHMARKS.md). These tests run on both.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import assert_greedy_dflash_equals_plain


@pytest.fixture(scope="module")
def demo():
    from hf2q.runtime.pair import load_pair

    pair = load_pair(None)
    assert pair.target.dtype == mx.bfloat16
    return pair


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]


@pytest.mark.parametrize("text", PROMPTS)
def test_verify_rows_are_bit_equal_to_decode_steps_in_bf16(demo, text):
    from hf2q.runtime.dflash import block_and_steps, plain_generate, run

    prompt = demo.tokenizer.encode(text)
    block = mx.array([run(plain_generate(demo.target, prompt, max_tokens=16)).tokens[:16]])
    capture = list(range(demo.target.num_layers))
    (logits_v, feats_v), (logits_d, feats_d) = block_and_steps(
        demo.target, prompt, block, capture=capture
    )
    assert feats_v.dtype == mx.bfloat16
    assert mx.array_equal(feats_v, feats_d)  # every layer's output, every row
    assert mx.array_equal(logits_v, logits_d)


def test_greedy_dflash_equals_plain_in_bf16(demo):
    prompts = [demo.tokenizer.encode(t) for t in PROMPTS]
    assert_greedy_dflash_equals_plain(
        demo.target, demo.drafter, prompts, [48, 40, 56], blocks=[16, 8, 4, "auto"], slots=2
    )


@pytest.mark.parametrize("slots", [1, 3])
def test_lagged_rounds_equal_plain_in_bf16(demo, slots):
    # Each round queued before the last acceptance is read (HF2Q_LAGGED_ROUNDS): the device-side
    # rollback and ragged drafter context keep every request's plain greedy tokens in bf16.
    from hf2q.runtime.dflash import plain_generate, run
    from hf2q.runtime.slots import Request, run_slots, slots_dflash_generate

    reqs = [Request(demo.tokenizer.encode(t), max_tokens=m) for t, m in zip(PROMPTS, [48, 40, 56])]
    got = run_slots(
        slots_dflash_generate(demo.target, demo.drafter, reqs, slots=slots, lagged=True)
    )
    want = [
        run(plain_generate(demo.target, r.prompt, max_tokens=r.max_tokens)).tokens for r in reqs
    ]
    assert [s.tokens for s in got.requests] == want
