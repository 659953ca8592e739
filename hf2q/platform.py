"""Facts about the machine MLX runs on: versions, device, and which BLAS the CPU backend uses.

On Linux the ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS, about 38x slower on the
matrix products that dominate prefill and verify than an optimized one (shared/docs/mlx-platforms.md).
This module reports which library is loaded and where a faster one can be found.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

#: Where Debian/Ubuntu put OpenBLAS ('apt-get install libopenblas0-pthread').
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def loaded_blas() -> str | None:
    """Path of the BLAS library mapped into this process (Linux only; None elsewhere)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    found = re.findall(r"(/\S*(?:openblas|libblas|mkl_rt|blis)\S*\.so[.\d]*)", maps.read_text())
    # numpy's bundled OpenBLAS has prefixed symbols (scipy_openblas): it cannot serve MLX.
    found = [f for f in dict.fromkeys(found) if "scipy_openblas" not in f]
    # An LD_PRELOADed optimized BLAS wins symbol resolution over the wheel's bundled one.
    preferred = [f for f in found if "openblas" in f or "mkl" in f or "blis" in f]
    return (preferred or found or [None])[0]


def find_openblas() -> str | None:
    """An OpenBLAS shared library on this system, if one is installed."""
    for cand in OPENBLAS_CANDIDATES:
        if os.path.exists(cand):
            return cand
    return None


def blas_kind(path: str | None) -> str:
    if path is None:
        return "accelerate" if sys.platform == "darwin" else "unknown"
    if "openblas" in path or "mkl" in path or "blis" in path:
        return "optimized"
    return "reference (slow)"


def describe() -> dict[str, str]:
    """Versions, default device and BLAS, for ``hf2q info`` and benchmark records."""
    import mlx.core as mx

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx-lm is a dependency
        mlx_lm_version = "missing"
    device = mx.default_device()
    cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    metal = bool(mx.metal.is_available())
    blas = loaded_blas()
    info = {
        "python": sys.version.split()[0],
        "platform": sys.platform,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "device": str(device),
        "backend": "cuda" if cuda else "metal" if metal else "cpu",
        "blas": blas or "-",
        "blas_kind": blas_kind(blas),
    }
    if (
        info["backend"] == "cpu"
        and sys.platform.startswith("linux")
        and info["blas_kind"] != "optimized"
    ):
        lib = find_openblas()
        info["blas_hint"] = (
            f"LD_PRELOAD={lib} speeds up MLX's CPU matmuls about 38x"
            if lib
            else "apt-get install libopenblas0-pthread, then LD_PRELOAD it, speeds up MLX's CPU matmuls about 38x"
        )
    return info
