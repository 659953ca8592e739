"""Qwen3.5-4B's shapes for the random-weight benchmarks, stated once.

The target is the ``text_config`` of Qwen3.5-4B's ``config.json`` (hidden 2560, 32 layers with
full attention every 4th, 16 / 4 heads of 256, MLP 9216, Gated-DeltaNet 16 key / 32 value heads
of 128, vocab 248320, tied embeddings); the drafter is z-lab's Qwen3.5-4B-DFlash (5 layers,
32 / 8 heads of 128, MLP 9728, target layers [1, 8, 15, 22, 29], mask row 248070), see
shared/docs/dflash.md. Used by ``verify_cost.py``, ``slots_synthetic.py`` and ``generate_bench.py``.
"""

from __future__ import annotations

from typing import Any

QWEN35_4B_TARGET: dict[str, Any] = dict(
    hidden_size=2560,
    num_hidden_layers=32,
    full_attention_interval=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    intermediate_size=9216,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=248320,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters={
        "type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
    },
)

QWEN35_4B_DRAFTER: dict[str, Any] = dict(
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    target_layer_ids=[1, 8, 15, 22, 29],
    mask_token_id=248070,
)
