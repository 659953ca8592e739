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


@pytest.mark.parametrize("dtype", [mx.bfloat16], ids=["bf16"])
def test_every_variant_compiles_for_sm90_without_spills(tmp_path: Path, dtype):
    kernels = []
    for fused in (False, True):
        for v in VARIANTS:
            joined = v.get("joined", False)
            if (joined or v.get("window")) and not fused:
                continue
            spec = cg.kernel_spec(fused=fused, **v)
            kernels.append((spec["name"], spec["name"], _gated_delta_kernel(spec, fused, dtype, v)))
    _assert_compile_without_spills(tmp_path, spec["header"], kernels)


def test_gdn_loads_timing_probes_apply_and_compile(tmp_path: Path):
    """benchmarks/gdn_loads.py's probes edit the kernel's text: each edit still finds its text
    once and the result compiles (a GPU run is not spent finding out). Warnings allowed: a probe
    leaves what it removes the use of (the conv read's helper) unused."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gdn_loads

    v = dict(record="final", write_y=True, replay=False, window=True)
    assert gdn_loads._variant(False) == dict(fused=True, step_loads=False, **v)
    kernels = []
    for probe in gdn_loads.PROBES:
        spec = gdn_loads.probe_spec(probe)
        kernels.append((probe, spec["name"], _gated_delta_kernel(spec, True, mx.bfloat16, v)))
    _assert_compile_without_spills(tmp_path, spec["header"], kernels, werror=False)


def _gated_delta_kernel(spec: dict, fused: bool, dtype, v: dict) -> str:
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
    return cuda_emu.mlx_cuda_kernel(
        spec["name"],
        spec["input_names"],
        in_dtypes,
        in_ndims,
        spec["output_names"],
        out_dtypes,
        spec["source"],
        template,
    )


def test_rollback_kernels_compile_for_sm90_without_spills(tmp_path: Path):
    """The rollback kernel for 6, 24 and 48 layers, and its conv-states-only form for 24."""
    import cuda_emu

    from hf2q.kernels import cuda_rollback as cr

    dt = mx.bfloat16
    kernels = []
    for layers, states in ((6, True), (24, True), (48, True), (24, False)):
        name, ins, outs, source = cr.spec(layers, states=states)
        n_in = [dt] * layers + ([mx.float32] * layers if states else []) + [mx.int32]
        nd_in = [3] * layers + ([5] * layers if states else []) + [1]
        n_out = [dt] * layers + ([mx.float32] * layers if states else [])
        template = [("CT", dt), ("T", 16), ("K1", 3), ("C", 8192)]
        template += [("S4", 131072)] if states else []
        unique = f"{name}_{layers}_{int(states)}"  # one translation unit: a name each
        text = cuda_emu.mlx_cuda_kernel(
            unique, ins, n_in, nd_in, outs, n_out, source, template + [("NT", cr.THREADS)]
        )
        kernels.append((f"{layers} layers, states {states}", unique, text))
    _assert_compile_without_spills(tmp_path, "", kernels)


# (m-tiles, column blocks, warps, unrolling) of default launches.
_LAUNCHES = [(1, 4, 8, 1), (1, 2, 8, 1), (2, 8, 8, 4), (3, 8, 8, 1), (4, 4, 8, 4), (8, 4, 8, 1)]
# (m-tiles, column blocks, warps, unrolling, column-split warps, chunks ahead):
# cuda_matmul.column_shape's, and HF2Q_MM_COLS64's with weights loaded 2-3 chunks ahead
_COLUMN_LAUNCHES = [
    (3, 2, 8, 1, 8, 1),
    (4, 2, 8, 1, 8, 1),
    (8, 1, 8, 1, 8, 1),
    (4, 2, 8, 1, 4, 3),
    (4, 2, 8, 1, 8, 3),
    (4, 4, 8, 1, 4, 2),
]


def test_small_mm_kernels_compile_for_sm90_without_spills(tmp_path: Path):
    import cuda_emu

    from hf2q.kernels import cuda_matmul as cm

    dt = mx.bfloat16
    variants = [
        (k, *launch, 1, 1)
        for k in ("single", "add", "grouped2", "grouped4")
        for launch in _LAUNCHES
    ]
    variants += [(k, *launch) for k in ("single", "add", "grouped2") for launch in _COLUMN_LAUNCHES]
    variants += [("swiglu", *launch, 1, 1) for launch in _LAUNCHES]  # (every one's NB >= 2)
    kernels = []
    for i, (kind, mt, nb, warps, unroll, cw, depth) in enumerate(variants):
        template = cm._template(dt, mt, nb, warps, unroll, cw, depth)
        if kind == "swiglu":
            source, ins, outs = cm._SOURCE_SWIGLU, ["x", "wg", "wu"], ["y"]
            template = cm._swiglu_template(dt, mt, nb, warps, unroll)
        elif kind.startswith("grouped"):
            g = int(kind[-1])
            ins = ["x", *(f"w{i}" for i in range(g))]
            outs = [f"y{i}" for i in range(g)]
            source = cm.grouped_source(g, cw > 1)
        elif kind == "add":
            source = cm._SOURCE_ADD_COLUMNS if cw > 1 else cm._SOURCE_ADD
            ins, outs = ["x", "w", "r"], ["y"]
        else:
            source = cm._SOURCE_COLUMNS if cw > 1 else cm._SOURCE
            ins, outs = ["x", "w"], ["y"]
        name = f"hf2q_mm_{kind}_{i}"  # one translation unit: a name each
        label = (
            f"{kind} m-tiles {mt}, column blocks {nb}, warps {warps}, unroll {unroll}, cw {cw},"
            f" ahead {depth}"
        )
        kernels.append(
            (
                label,
                name,
                cuda_emu.mlx_cuda_kernel(
                    name,
                    ins,
                    [dt] * len(ins),
                    [2] * len(ins),
                    outs,
                    [dt] * len(outs),
                    source,
                    template,
                ),
            )
        )
    # (the SwiGLU launch's header: the others' and the Gated-DeltaNet kernel's sigmoid)
    report = _assert_compile_without_spills(tmp_path, cm._swiglu_header(), kernels)
    # The column split's shared memory is what cuda_matmul.shared_bytes counts (tunes check it)
    for i, (kind, mt, nb, warps, _, cw, depth) in enumerate(variants):
        if cw > 1:
            want = cm.shared_bytes(mt, nb, warps, cw, depth)
            assert _shared_bytes(report, f"hf2q_mm_{kind}_{i}") == want, (kind, mt, nb, cw, depth)


def test_normed_mm_kernels_compile_for_sm90_without_spills(tmp_path: Path):
    # The launches that norm their rows (every default launch: HF2Q_NORM_MM_ROWS may allow them),
    # and the joined one (a drafter layer's context then normed block rows).
    import cuda_emu

    from hf2q.kernels import cuda_matmul as cm

    dt = mx.bfloat16
    kernels = []
    for i, (kind, (mt, nb, warps, unroll)) in enumerate(
        (k, launch)
        for k in ("single", "grouped2", "grouped3", "grouped4", "swiglu", "joined2")
        for launch in _LAUNCHES
    ):
        if kind == "swiglu":
            source, ins, outs = cm._swiglu_source(True), ["x", "wg", "wu"], ["y"]
        elif kind == "joined2":
            source, ins, outs = (
                cm.grouped_source(2, norm=True, joined=True),
                ["x", "c", "w0", "w1"],
                ["y0", "y1"],
            )
        elif kind.startswith("grouped"):
            g = int(kind[-1])
            ins, outs = ["x", *(f"w{j}" for j in range(g))], [f"y{j}" for j in range(g)]
            source = cm.grouped_source(g, norm=True)
        else:
            source, ins, outs = cm._SOURCE_NORMED, ["x", "w"], ["y"]
        name = f"hf2q_norm_mm_{kind}_{i}"
        label = f"normed {kind} m-tiles {mt}, column blocks {nb}, warps {warps}, unroll {unroll}"
        ins = [*ins, "nw"]
        if kind == "joined2":  # (cuda_matmul.joined_matmul_cuda: never unrolled)
            unroll = 1
        template = cm._template(dt, mt, nb, warps, unroll)
        template = template[:5] if kind == "swiglu" else template
        kernel = cuda_emu.mlx_cuda_kernel(
            name,
            ins,
            [dt] * len(ins),
            [2] * (len(ins) - 1) + [1],
            outs,
            [dt] * len(outs),
            cm.norm_source(source, 1e-6),
            template,
        )
        kernels.append((label, name, kernel))
    _assert_compile_without_spills(tmp_path, cm.norm_header(), kernels)


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


_PROPERTIES = re.compile(
    r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads"
)


def _assert_compile_without_spills(
    tmp_path: Path,
    header: str,
    kernels: list[tuple[str, str, str]],
    werror: bool = True,
    stack: int = 0,
) -> str:
    """Each of ``kernels`` ((label, name, text), text from ``cuda_emu.mlx_cuda_kernel``; the
    names distinct) compiles with ``header`` without spills, with a stack frame of exactly
    ``stack`` bytes (none by default). One translation unit for them all: nvcc's start costs
    ~2.5 s here, more than most of these kernels' own compile; ptxas reports each function
    apart. Returns the report."""
    import cuda_emu

    names = [name for _, name, _ in kernels]
    assert len(set(names)) == len(names), "each kernel needs its own name"
    src = cuda_emu.mlx_cuda_prelude(header) + "".join(text for _, _, text in kernels)
    report = _compile_report(tmp_path, names[0], src, werror)
    found = {m.group(1): tuple(map(int, m.groups()[1:])) for m in _PROPERTIES.finditer(report)}
    bad = []
    for label, name, _ in kernels:
        # An Itanium-mangled name holds each identifier as its length then its text.
        mine = [v for f, v in found.items() if re.search(rf"(?<!\d){len(name)}{name}", f)]
        if mine != [(stack, 0, 0)]:
            bad.append(f"{label}: {mine or 'no report'} (stack frame, spill stores, spill loads)")
    assert not bad, "\n".join(bad) + "\n" + report[-3000:]
    return report


def _shared_bytes(report: str, name: str) -> int:
    """The static shared memory ptxas gives kernel ``name`` in ``report``."""
    for part in report.split("Compiling entry function '")[1:]:
        if re.match(rf"[^']*(?<!\d){len(name)}{name}", part):
            return int(re.search(r"(\d+) bytes smem", part).group(1))
    raise AssertionError(f"no report for {name}")


# (column blocks, warps, unrolling): the wider launches of the 4-bit head at one m-tile that
# benchmarks/h200_s50.sh timed (quant_rows.py --tune; session 50: 4,4,1 285 us at 15 rows
# against the default's 330)
_QHEAD_TUNE = [(8, 4, 1), (16, 4, 1), (8, 8, 1), (4, 4, 1)]


def test_small_qmm_kernels_compile_for_sm90_without_spills(tmp_path: Path):
    import cuda_emu

    from hf2q.kernels import cuda_matmul as cm

    dt = mx.bfloat16
    variants = [(*launch, False, bits) for bits in (4, 8) for launch in _LAUNCHES]
    variants += [(*launch, True, 4) for launch in _LAUNCHES[:3]]
    variants += [(1, *launch, False, 4) for launch in _QHEAD_TUNE]
    kernels = []
    for i, (mt, nb, warps, unroll, add, bits) in enumerate(variants):
        ins = ["x", "w", "s", "b", "r"] if add else ["x", "w", "s", "b"]
        name = f"hf2q_small_qmm{'_add' if add else ''}_{i}"
        label = f"{bits} bits, add {add}, m-tiles {mt}, column blocks {nb}, warps {warps}, unroll {unroll}"
        text = cuda_emu.mlx_cuda_kernel(
            name,
            ins,
            [dt, mx.uint32, dt, dt, dt][: len(ins)],
            [2] * len(ins),
            ["y"],
            [dt],
            cm._QSOURCE_ADD if add else cm._QSOURCE,
            cm._template(dt, mt, nb, warps, unroll) + [("BITS", bits), ("GS", 64)],
        )
        kernels.append((label, name, text))
    _assert_compile_without_spills(tmp_path, cm._QHEADER, kernels)


def test_gated_norm_launch_compiles_for_sm90_without_spills(tmp_path: Path):
    import cuda_emu

    from hf2q.kernels import cuda_norm as cn

    kernels = [
        (
            f"gated_norm_{dt}_{Dv}",
            f"hf2q_gated_norm_{i}",
            cuda_emu.mlx_cuda_kernel(
                f"hf2q_gated_norm_{i}",
                ["y", "z", "w"],
                [dt, dt, dt],
                [2, 2, 1],
                ["out"],
                [dt],
                cn.source(1e-6),
                [("InT", dt), ("D", Dv)],
            ),
        )
        for i, (dt, Dv) in enumerate([(mx.bfloat16, 128), (mx.float16, 128), (mx.bfloat16, 64)])
    ]
    # the norm + RoPE launch: the 4B target's queries and keys, a drafter's whole-head rotation
    ropes = []
    for i, (H, RS, D, R) in enumerate([(16, 512, 256, 64), (4, 256, 256, 64), (32, 128, 128, 128)]):
        name = f"hf2q_norm_rope_{i}"
        src = cuda_emu.mlx_cuda_kernel(
            name,
            ["x", "w", "off"],
            [mx.bfloat16, mx.bfloat16, mx.int32],
            [3, 1, 1],
            ["out"],
            [mx.bfloat16],
            cn.rope_source(1e-6, 1e7, 1.0),
            [("InT", mx.bfloat16), ("H", H), ("RS", RS), ("D", D), ("R", R)],
        )
        ropes.append((f"norm_rope_{D}_{R}", name, src))
    _assert_compile_without_spills(tmp_path, cn._HEADER, kernels)
    # (32 bytes of stack: cosf and sinf's reduction of large arguments keeps a local table, as
    # in MLX's own RoPE kernel; no spills)
    _assert_compile_without_spills(tmp_path, cn._HEADER, ropes, stack=32)


def test_row_attention_launches_compile_for_sm90_without_spills(tmp_path: Path):
    """The row-invariant attention's launches at the 4B target's shape (groups of 4 query heads
    of 256, the whole-row launch, the chunked pair) and the drafter's (128), with the output gate
    in the store (``HF2Q_ATTN_GATE``) and without."""
    import cuda_emu

    from hf2q.kernels import cuda_attention as ca

    dims = {"q": 4, "k": 4, "v": 4, "off": 1, "scale": 1, "gate": 3, "part": 4, "ml": 4}
    kinds = {"off": mx.int32, "scale": mx.float32, "part": mx.float32, "ml": mx.float32}
    kernels = []
    for D, causal in ((256, True), (128, False)):
        G = 4
        base = [("T", mx.bfloat16), ("G", G), ("HB", ca.heads_per_block(G)), ("D", D)]
        base += [("WARPS", ca.warps(G, D)), ("CAUSAL", causal), ("WINDOW", 0)]
        for kind, (name, ins, outs, src, _) in ca.SPECS.items():
            # the template arguments ca._launch gives each launch
            template = [a for a in base if a[0] != "HB" or not kind.startswith("merge")]
            template += [] if kind.startswith("whole") else [("CH", ca.CHUNK)]
            template += [("GS", 2 * D), ("GO", D)] if kind.endswith("gated") else []
            label = f"{kind}_{D}"
            out_dtypes = [mx.float32, mx.float32] if kind == "part" else [mx.bfloat16]
            kernels.append(
                (
                    label,
                    f"{name}_{D}",
                    cuda_emu.mlx_cuda_kernel(
                        f"{name}_{D}",
                        ins,
                        [kinds.get(n, mx.bfloat16) for n in ins],
                        [dims[n] for n in ins],
                        outs,
                        out_dtypes,
                        src,
                        template,
                    ),
                )
            )
    header = ca.SPECS["whole_gated"][4]  # every launch's header is a prefix of this one's
    # (warnings allowed: the merge launch is given template arguments it does not read)
    _assert_compile_without_spills(tmp_path, header, kernels, werror=False)
