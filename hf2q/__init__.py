"""hf2q: quantize Hugging Face checkpoints for MLX and run lossless DFlash speculative decoding.

Importing this package is cheap: it never imports MLX, mlx-lm or transformers. Those load inside
the functions that need them, so ``hf2q --help`` stays fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
