"""Fused kernels with ops references; they know nothing of the runtime.

- ``cuda_gated_delta``: Gated-DeltaNet recurrence kernels for MLX's CUDA backend (plain and fused
  conv + norm + gates + recurrence), recording per-step states or replaying for rollback.
- ``gdn``: Gated-DeltaNet layers as pure functions over mlx-lm's modules, with exact rollback.
- ``attention``: the Qwen3.5 full-attention layer as compiled pieces around mlx-lm's KV cache.
- ``cuda_attention``: row-invariant attention over a KV cache buffer (CUDA, bf16/fp16): a query
  row's bits do not depend on the rows computed with it, so verify rows equal decode steps.
- ``cuda_matmul`` / ``linear``: small-M products on tensor cores (CUDA) and their dispatch.
- ``layers``: compiled runners cached per layer and a fast ``TargetModel.forward`` layer function.
- ``select``: which implementation runs here (automatic; ``describe()`` for ``--stats``).

Importing this package imports nothing heavy; import the submodules where they are used.
"""
