"""The CUDA kernel sources compile for Hopper (sm_90a, what MLX targets on an H100/H200).

Uses ``nvcc`` where it is installed (the sources are compiled exactly as MLX wraps them, with the
CUDA headers standing in for MLX's device header) and checks the resource report: no spills, no
local-memory stack frame. Skipped where there is no ``nvcc``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from hf2q.kernels import cuda_gated_delta as cg

NVCC = shutil.which("nvcc")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NVCC is None, reason="nvcc is not installed"),
]

VARIANTS = [
    dict(record="states", write_y=True, replay=False),
    dict(record="final", write_y=True, replay=False),
    dict(record="final", write_y=False, replay=True),
    dict(record="final", write_y=False, replay=True, joined=True),
    dict(record="states", write_y=True, replay=False, window=True),
    dict(record="final", write_y=True, replay=False, window=True),
    # the fused kernel's conv read before session 48 (benchmarks/gdn_loads.py times it)
    dict(record="final", write_y=True, replay=False, window=True, step_loads=True),
]


def _dtypes(fused: bool, dt, joined: bool = False):
    if fused:
        return [dt, dt, dt, dt, dt, mx.float32, dt, mx.float32][int(joined) :]
    return [dt, dt, dt, mx.float32, dt, mx.float32]


@pytest.mark.parametrize("fused", [False, True], ids=["steps", "fused"])
@pytest.mark.parametrize("dtype", [mx.bfloat16], ids=["bf16"])
def test_every_variant_compiles_for_sm90_without_spills(tmp_path: Path, fused, dtype):
    for v in VARIANTS:
        joined = v.get("joined", False)
        if (joined or v.get("window")) and not fused:
            continue
        _compile_gated_delta(tmp_path, cg.kernel_spec(fused=fused, **v), fused, dtype, v)


def test_gdn_loads_timing_probes_apply_and_compile(tmp_path: Path):
    """benchmarks/gdn_loads.py's probes edit the kernel's text: each edit still finds its text
    once and the result compiles (a GPU run is not spent finding out). Warnings allowed: a probe
    leaves what it removes the use of (the conv read's helper) unused."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gdn_loads

    v = dict(record="final", write_y=True, replay=False, window=True)
    assert gdn_loads._variant(False) == dict(fused=True, step_loads=False, **v)
    for probe in gdn_loads.PROBES:
        spec = gdn_loads.probe_spec(probe)
        _compile_gated_delta(tmp_path, spec, True, mx.bfloat16, v, werror=False)


def _compile_gated_delta(
    tmp_path: Path, spec: dict, fused: bool, dtype, v: dict, werror: bool = True
) -> None:
    import cuda_emu

    joined = v.get("joined", False)
    in_dtypes = _dtypes(fused, dtype, joined) + ([mx.int32] if v["replay"] else [])
    in_ndims = [4, 4, 4, 3, 3, 4] if not fused else [3, 3, 2, 3, 3, 1, 1, 4][int(joined) :]
    in_ndims += [1] if v["replay"] else []
    out_dtypes = ([dtype] if v["write_y"] else []) + [mx.float32]
    out_dtypes += [dtype] if v.get("window") else []
    template = [("InT", dtype)] + ([("GT", dtype)] if fused else [])
    template += [("Dk", 128), ("Dv", 128), ("Hk", 16), ("Hv", 32)]
    template += ([("KC", 4)] if fused else []) + [("WARPS", 4), ("TC", 16)]
    src = cuda_emu.mlx_cuda_source(
        spec["name"],
        spec["input_names"],
        in_dtypes,
        in_ndims,
        spec["output_names"],
        out_dtypes,
        spec["source"],
        spec["header"],
        template,
    )
    _assert_compiles_without_spills(tmp_path, spec["name"], src, werror)


@pytest.mark.parametrize("layers", [6, 24, 48])
def test_rollback_kernel_compiles_for_sm90_without_spills(tmp_path: Path, layers):
    import cuda_emu

    from hf2q.kernels import cuda_rollback as cr

    name, ins, outs, source = cr.spec(layers)
    dt = mx.bfloat16
    src = cuda_emu.mlx_cuda_source(
        name,
        ins,
        [dt] * layers + [mx.float32] * layers + [mx.int32],
        [3] * layers + [5] * layers + [1],
        outs,
        [dt] * layers + [mx.float32] * layers,
        source,
        "",
        [("CT", dt), ("T", 16), ("K1", 3), ("C", 8192), ("S4", 131072), ("NT", cr.THREADS)],
    )
    _assert_compiles_without_spills(tmp_path, name, src)


@pytest.mark.parametrize("layers", [24])
def test_conv_rollback_kernel_compiles_for_sm90_without_spills(tmp_path: Path, layers):
    import cuda_emu

    from hf2q.kernels import cuda_rollback as cr

    name, ins, outs, source = cr.spec(layers, states=False)
    dt = mx.bfloat16
    src = cuda_emu.mlx_cuda_source(
        name,
        ins,
        [dt] * layers + [mx.int32],
        [3] * layers + [1],
        outs,
        [dt] * layers,
        source,
        "",
        [("CT", dt), ("T", 16), ("K1", 3), ("C", 8192), ("NT", cr.THREADS)],
    )
    _assert_compiles_without_spills(tmp_path, name, src)


# (m-tiles, column blocks, warps, unrolling) of default launches.
_LAUNCHES = [(1, 4, 8, 1), (1, 2, 8, 1), (2, 8, 8, 4), (3, 8, 8, 1), (4, 4, 8, 4), (8, 4, 8, 1)]
# (m-tiles, column blocks, warps, unrolling, column-split warps): cuda_matmul.column_shape's
_COLUMN_LAUNCHES = [(3, 2, 8, 1, 8), (4, 2, 8, 1, 8), (8, 1, 8, 1, 8)]


@pytest.mark.parametrize(
    "kind,mt,nb,warps,unroll,cw",
    [(k, *launch, 1) for k in ("single", "add", "grouped2", "grouped4") for launch in _LAUNCHES]
    + [(k, *launch) for k in ("single", "add", "grouped2") for launch in _COLUMN_LAUNCHES],
)
def test_small_mm_kernels_compile_for_sm90_without_spills(
    tmp_path: Path, kind, mt, nb, warps, unroll, cw
):
    import cuda_emu

    from hf2q.kernels import cuda_matmul as cm

    dt = mx.bfloat16
    if kind.startswith("grouped"):
        g = int(kind[-1])
        name, ins, outs, source = (
            f"hf2q_grouped_mm{g}",
            ["x", *(f"w{i}" for i in range(g))],
            [f"y{i}" for i in range(g)],
            cm.grouped_source(g, cw > 1),
        )
    elif kind == "add":
        source = cm._SOURCE_ADD_COLUMNS if cw > 1 else cm._SOURCE_ADD
        name, ins, outs = "hf2q_small_mm_add", ["x", "w", "r"], ["y"]
    else:
        source = cm._SOURCE_COLUMNS if cw > 1 else cm._SOURCE
        name, ins, outs = "hf2q_small_mm", ["x", "w"], ["y"]
    ndims = [2] + [2] * (len(ins) - 1)
    src = cuda_emu.mlx_cuda_source(
        name,
        ins,
        [dt] * len(ins),
        ndims,
        outs,
        [dt] * len(outs),
        source,
        cm._HEADER,
        cm._template(dt, mt, nb, warps, unroll, cw),
    )
    _assert_compiles_without_spills(tmp_path, name, src)


def _compile_report(tmp_path: Path, name: str, src: str, werror: bool = True) -> str:
    """ptxas's report of compiling ``src`` for sm_90a (warnings are errors unless not
    ``werror``)."""
    cu = tmp_path / f"{name}.cu"
    cu.write_text(src)
    res = subprocess.run(
        [
            NVCC,
            "-gencode=arch=compute_90a,code=sm_90a",
            "-std=c++17",
            "-cubin",
            "-Xptxas",
            "-v",
            *(["-Werror", "all-warnings"] if werror else []),
            "-o",
            str(tmp_path / "k.cubin"),
            str(cu),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def _assert_compiles_without_spills(
    tmp_path: Path, name: str, src: str, werror: bool = True
) -> None:
    report = _compile_report(tmp_path, name, src, werror)
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report), (
        report
    )


# (column blocks, warps, unrolling): the wider launches of the 4-bit head at one m-tile that
# benchmarks/h200_s50.sh timed (quant_rows.py --tune; session 50: 4,4,1 285 us at 15 rows
# against the default's 330)
_QHEAD_TUNE = [(8, 4, 1), (16, 4, 1), (8, 8, 1), (4, 4, 1)]


@pytest.mark.parametrize(
    "mt,nb,warps,unroll,add,bits",
    [(*launch, False, bits) for bits in (4, 8) for launch in _LAUNCHES]
    + [(*launch, True, 4) for launch in _LAUNCHES[:3]]
    + [(1, *launch, False, 4) for launch in _QHEAD_TUNE],
)
def test_small_qmm_kernels_compile_for_sm90_without_spills(
    tmp_path: Path, mt, nb, warps, unroll, add, bits
):
    import cuda_emu

    from hf2q.kernels import cuda_matmul as cm

    dt = mx.bfloat16
    ins = ["x", "w", "s", "b", "r"] if add else ["x", "w", "s", "b"]
    src = cuda_emu.mlx_cuda_source(
        "hf2q_small_qmm_add" if add else "hf2q_small_qmm",
        ins,
        [dt, mx.uint32, dt, dt, dt][: len(ins)],
        [2] * len(ins),
        ["y"],
        [dt],
        cm._QSOURCE_ADD if add else cm._QSOURCE,
        cm._QHEADER,
        cm._template(dt, mt, nb, warps, unroll) + [("BITS", bits), ("GS", 64)],
    )
    _assert_compiles_without_spills(tmp_path, "hf2q_small_qmm", src)
