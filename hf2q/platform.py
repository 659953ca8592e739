"""Facts about the machine MLX runs on: versions, device, and which BLAS the CPU backend uses.

On Linux the ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS, about 38x slower on the
matrix products that dominate prefill and verify than an optimized one (shared/docs/mlx-platforms.md).
This module reports which library is loaded and where a faster one can be found: a system
OpenBLAS, or Intel's MKL runtime from PyPI (``pip install mkl``, x86-64) where no system package
can be installed.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Where Debian/Ubuntu put OpenBLAS ('apt-get install libopenblas0-pthread').
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def keep_float32_exact(environ: dict[str, str] | None = None) -> None:
    """Ask MLX for true float32 matrix products on CUDA unless the user chose otherwise.

    MLX's CUDA backend runs float32 GEMMs as TF32 (10-bit mantissa) by default
    (``MLX_ENABLE_TF32=1``) but matrix-vector products in full float32, so a verify block (a GEMM)
    and a decode step (a GEMV) of the same float32 model round differently and greedy DFlash can
    drift from plain greedy decoding. Setting ``MLX_ENABLE_TF32=0`` before the first product keeps
    float32 exact; bfloat16 and quantized models are unaffected. Call before MLX computes anything.
    """
    env = os.environ if environ is None else environ
    env.setdefault("MLX_ENABLE_TF32", "0")


#: Additions in :func:`host_loop_ms`'s loop.
HOST_LOOP_ADDS = 10**6


def host_loop_ms(adds: int = HOST_LOOP_ADDS) -> float:
    """Milliseconds this Python takes for a loop of ``adds`` integer additions, best of three.

    Why it goes in benchmark records: small models' decode steps and DFlash rounds are bound by
    the host (Python building MLX graphs, MLX encoding them), so their speed follows the CPU the
    run had. On the lent H200 machines a loop of 10**7 additions took 0.68-1.56 s, and the same
    code gave the demo pair 1.57x plain batched decoding at 8 slots on the fastest host and 1.40x
    on a slow one (docs/BENCHMARKS.md, sessions 27-32). With this figure two records can be told
    apart by their host rather than their code.
    """
    best = float("inf")
    for _ in range(3):
        tic = time.perf_counter()
        s = 0
        for i in range(adds):
            s += i
        best = min(best, time.perf_counter() - tic)
    return round(best * 1e3, 2)


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


def find_pip_mkl(prefixes: tuple[str, ...] | None = None) -> str | None:
    """MKL's runtime library as ``pip install mkl`` puts it (``<prefix>/lib/libmkl_rt.so.N``).

    Searched under this Python's prefixes (the virtual environment, then the base install) or
    ``prefixes``; the highest version found in the first prefix that has one. It exports the
    standard ``cblas_*`` symbols, so preloading it serves MLX's CPU matmuls like OpenBLAS does.
    """
    for prefix in prefixes or tuple(dict.fromkeys((sys.prefix, sys.base_prefix))):
        found = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), key=_so_version)
        if found:
            return found[-1]
    return None


def _so_version(path: str) -> tuple[int, ...]:
    tail = path.rsplit(".so", 1)[-1]
    return tuple(int(x) for x in tail.split(".") if x.isdigit())


def find_fast_blas() -> str | None:
    """The optimized BLAS to preload: a system OpenBLAS, else a pip-installed MKL, else None."""
    return find_openblas() or find_pip_mkl()


#: :func:`blas_kind` of the reference (netlib) BLAS that Linux's ``mlx[cpu]`` wheel bundles.
REFERENCE_BLAS = "reference (slow)"


def blas_kind(path: str | None) -> str:
    if path is None:
        return "accelerate" if sys.platform == "darwin" else "unknown"
    if "openblas" in path or "mkl" in path or "blis" in path:
        return "optimized"
    return REFERENCE_BLAS


def blas_role(kind: str, backend: str) -> str:
    """``kind`` as reported: on a GPU backend MLX's matrix products do not use the CPU BLAS."""
    return kind if backend == "cpu" else f"{kind}; not used: MLX computes on {backend}"


def describe() -> dict[str, str]:
    """Versions, default device and BLAS, for ``hf2q info`` and benchmark records."""
    import mlx.core as mx

    from hf2q.kernels.select import backend

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
        "blas_kind": blas_role(blas_kind(blas), backend()),
    }
    if (
        info["backend"] == "cpu"
        and sys.platform.startswith("linux")
        and info["blas_kind"] != "optimized"
    ):
        lib = find_fast_blas()
        info["blas_hint"] = (
            f"{preload_words(lib)} speeds up MLX's CPU matmuls about 38x"
            if lib
            else f"{INSTALL_FAST_BLAS}, then LD_PRELOAD it, speeds up MLX's CPU matmuls about 38x"
        )
    return info


# ---- getting the fast BLAS without knowing ------------------------------------------------------
#: Set in the re-executed child so it never re-executes again.
REEXEC_GUARD = "HF2Q_BLAS_REEXEC"
#: ``HF2Q_BLAS=bundled`` keeps the wheel's BLAS; ``HF2Q_BLAS=/path/lib.so`` preloads that library.
BLAS_ENV = "HF2Q_BLAS"
#: How to install a BLAS hf2q finds by itself (:func:`find_fast_blas`).
INSTALL_FAST_BLAS = (
    "'apt-get install libopenblas0-pthread' (or, on x86-64 without root, 'pip install mkl')"
)


#: MKL's threading layer when hf2q preloads it and the user has not chosen one. Its default
#: (``INTEL``) needs the ``intel-openmp`` package (without it the process dies at the first
#: product: ``undefined symbol: omp_get_num_procs``), and ``GNU`` made a 1 x 256 x 768 product take
#: 7.97 ms on this project's 2-core CPU against 0.04 ms sequential (2026-12-03).
MKL_THREADING = "SEQUENTIAL"


def preload_env(library: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to re-execute with ``library`` preloaded (and the re-exec guard set)."""
    env = dict(environ)
    env[REEXEC_GUARD] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    if "mkl" in os.path.basename(library):
        env.setdefault("MKL_THREADING_LAYER", MKL_THREADING)
    return env


def preload_words(library: str) -> str:
    """The environment assignments a user would run with to preload ``library`` themselves."""
    env = preload_env(library, {})
    keys = [k for k in ("MKL_THREADING_LAYER", "LD_PRELOAD") if k in env]
    return " ".join(f"{k}={env[k]}" for k in keys)


def blas_hint(plan: BlasPlan) -> str:
    """The one-line hint for a ``"hint"`` plan: how to get the fast BLAS."""
    if plan.library:
        how = f"run with {preload_words(plan.library)} to use it"
    else:
        how = f"{INSTALL_FAST_BLAS} and hf2q will use it automatically"
    return (
        "MLX is using its bundled reference BLAS, about 38x slower on CPU matmuls: "
        f"{how} ({BLAS_ENV}=bundled silences this)"
    )


@dataclass(frozen=True)
class BlasPlan:
    """What to do about the CPU BLAS before running a model.

    Attributes:
        action: ``"reexec"`` (restart the process with ``library`` in LD_PRELOAD), ``"hint"``
            (tell the user once how to get a fast BLAS) or ``"keep"``.
        library: the shared library to preload for ``"reexec"``.
        reason: one line saying why.
    """

    action: str
    library: str | None
    reason: str


def plan_blas(
    *,
    system: str,
    backend: str,
    loaded_kind: str,
    installed: str | None,
    env: Mapping[str, str],
) -> BlasPlan:
    """Decide how to get an optimized BLAS (a pure function of its inputs; see ``ensure_fast_blas``).

    Args:
        system: ``sys.platform``.
        backend: ``"cpu"``, ``"cuda"`` or ``"metal"`` (what MLX runs on).
        loaded_kind: :func:`blas_kind` of the BLAS mapped into this process now.
        installed: an installed optimized BLAS (:func:`find_fast_blas`) or None.
        env: the environment (``HF2Q_BLAS``, the re-exec guard, ``LD_PRELOAD``).
    """
    if not system.startswith("linux") or backend != "cpu":
        return BlasPlan(
            "keep", None, f"MLX runs on {backend} ({system}): the CPU BLAS does not matter"
        )
    if loaded_kind == "optimized":
        return BlasPlan("keep", None, "an optimized BLAS is already loaded")
    choice = env.get(BLAS_ENV, "")
    if choice == "bundled":
        return BlasPlan("keep", None, f"{BLAS_ENV}=bundled keeps the bundled reference BLAS")
    if env.get(REEXEC_GUARD):
        return BlasPlan("hint", None, "the preloaded BLAS did not take effect after re-executing")
    library = choice if choice and os.path.isfile(choice) else installed
    if library is None:
        return BlasPlan("hint", None, "no optimized BLAS is installed")
    if library in env.get("LD_PRELOAD", "").split(":"):
        return BlasPlan("hint", None, f"{library} is in LD_PRELOAD but was not loaded")
    return BlasPlan("reexec", library, f"re-executing with LD_PRELOAD={library}")


def ensure_fast_blas(*, allow_reexec: bool) -> BlasPlan:
    """Apply :func:`plan_blas` to this process: maybe re-execute it with a fast BLAS preloaded.

    Call it at the start of a command that runs models, before reading stdin or writing
    anything. With ``allow_reexec`` False (hf2q called as a library, e.g. from tests) a
    ``"reexec"`` plan is downgraded to ``"hint"``. Does not return when it re-executes.
    """
    import mlx.core as mx

    cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    backend = "cuda" if cuda else "metal" if mx.metal.is_available() else "cpu"
    plan = plan_blas(
        system=sys.platform,
        backend=backend,
        loaded_kind=blas_kind(loaded_blas()),
        installed=find_fast_blas(),
        env=os.environ,
    )
    if plan.action == "reexec":
        if not allow_reexec:
            return BlasPlan("hint", plan.library, "not re-executing a process hf2q does not own")
        env = preload_env(plan.library, os.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    return plan


def blas_summary() -> dict[str, str]:
    """``{"blas": path or "-", "blas_kind": ...}`` of this process, for stats and JSON."""
    from hf2q.kernels.select import backend

    path = loaded_blas()
    return {"blas": path or "-", "blas_kind": blas_role(blas_kind(path), backend())}
