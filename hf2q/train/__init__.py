"""Training DFlash drafters on MLX (``hf2q train-draft``).

Modules: ``objective`` (anchors, the batched block forward with its attention mask, the decayed
loss), ``data`` (reading, tokenizing, regenerating and batching training text), ``trainer`` (the
loop: optimizer, schedule, checkpoints, evaluation with the real DFlash decoding loop, output in
z-lab's format). Importing this package does not import MLX.
"""
