"""Run ``mx.fast.cuda_kernel`` sources on the CPU: a test harness for machines without a GPU.

What it does: wrap a kernel body exactly the way MLX's CUDA backend does (inputs as ``const T*``,
outputs as ``T*``, template arguments as ``constexpr`` / ``using`` lines at the top of the body),
prepend a small C++ prelude that provides the CUDA pieces the hf2q kernels use (``blockIdx``,
``blockDim``, ``threadIdx``, ``__shared__``, ``__syncthreads``, ``__shfl_xor_sync``, ``__shfl_sync``, ``float4``, bf16/fp16
conversions with round-to-nearest-even), compile it with the host C++ compiler, and run every
thread of a block as a fiber (blocks one after another, on the same fibers) switched at its
barriers, so barriers and warp shuffles behave as on a GPU. :func:`emulated_kernel` returns an object called like the result of
``mx.fast.cuda_kernel``.

What it does not do: model the GPU memory system, warp divergence rules or timing; it checks the
arithmetic, the indexing and the synchronisation of a kernel, not its speed. The real CUDA tests
(``@pytest.mark.cuda``) run the same kernels on the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

PRELUDE = r"""
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <cstdio>
#include <cstdlib>
#include <csetjmp>
#include <ucontext.h>
#include <vector>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
using std::min;
using std::max;
// The threads of a block run as fibers on the launching thread, switched only at a barrier
// (__syncthreads and the warp shuffles): a waiter switches back to the scheduler, which resumes
// the fibers in turn, reversing its order each pass so that a missing barrier shows up whichever
// thread writes first. A pass in which no fiber arrives anywhere or finishes is a deadlock (the
// kernel hangs on a GPU): the launch says so and aborts. (Session 53: one OS thread per GPU
// thread, woken by futexes, made a barrier cost scheduling; with fibers an emulated attention
// launch took 0.09-0.34 s where it had taken 2.0-8.1 s.)
static long hf2q_progress = 0;
inline void hf2q_yield();
struct hf2q_barrier {
  const int n;
  int count = 0, gen = 0;
  explicit hf2q_barrier(int n_) : n(n_) {}
  void arrive_and_wait() {
    ++hf2q_progress;
    if (++count == n) {
      count = 0;
      ++gen;
      return;
    }
    const int g = gen;
    while (gen == g) hf2q_yield();
  }
};
struct hf2q_dim3 { unsigned x, y, z; };
static hf2q_dim3 blockIdx;
static hf2q_dim3 blockDim;
static hf2q_dim3 threadIdx;
// A fiber starts from a ucontext (its own stack). It switches with _setjmp/_longjmp, which do
// not save the signal mask (glibc's swapcontext makes a system call for it at every switch: the
// emulated attention launches ran about 10x slower so), except where x86 shadow stacks are on (a
// longjmp cannot move between them) or HF2Q_EMU_SWAPCONTEXT=1: then with swapcontext.
struct hf2q_fiber {
  ucontext_t uc;
  jmp_buf jb;
  hf2q_dim3 thread, block;
  bool started = false, done = false;
};
static hf2q_fiber* hf2q_current = nullptr;
static ucontext_t hf2q_scheduler_uc;
static jmp_buf hf2q_scheduler_jb;
static bool hf2q_jump = true;
inline bool hf2q_shadow_stacks() {
  bool shadow = false;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, f))
      shadow |= !std::strncmp(line, "x86_Thread_features:", 20) && std::strstr(line, "shstk");
    std::fclose(f);
  }
  return shadow;
}
// Decided at each launch (the environment may change between them).
inline bool hf2q_may_jump() {
  static const bool shadow = hf2q_shadow_stacks();
  const char* forced = std::getenv("HF2Q_EMU_SWAPCONTEXT");
  return !shadow && !(forced && forced[0] == '1');
}
// From the running fiber back to the scheduler.
inline void hf2q_switch_out() {
  hf2q_fiber* f = hf2q_current;
  if (!hf2q_jump) {
    swapcontext(&f->uc, &hf2q_scheduler_uc);
  } else if (!_setjmp(f->jb)) {
    _longjmp(hf2q_scheduler_jb, 1);
  }
}
// Run fiber f until it switches out.
inline void hf2q_switch_in(hf2q_fiber* f) {
  hf2q_current = f;
  threadIdx = f->thread;
  blockIdx = f->block;
  const bool resume = f->started;
  f->started = true;
  if (!hf2q_jump) {
    swapcontext(&hf2q_scheduler_uc, &f->uc);
  } else if (!_setjmp(hf2q_scheduler_jb)) {
    if (resume) _longjmp(f->jb, 1);
    setcontext(&f->uc);
  }
}
inline void hf2q_yield() {
  hf2q_current->block = blockIdx;
  hf2q_switch_out();
}
// Run tx fibers of main(thread) to their end; false on a deadlock.
inline bool hf2q_run_fibers(int tx, void (*main)(int)) {
  constexpr size_t stack = 256 * 1024;
  static char* stacks = nullptr;  // kept for the next launch (malloc'd: untouched until used)
  static int stacks_for = 0;
  if (stacks_for < tx) {
    std::free(stacks);
    stacks = static_cast<char*>(std::malloc(stack * tx));
    stacks_for = tx;
  }
  hf2q_jump = hf2q_may_jump();
  std::vector<hf2q_fiber> fibers(tx);
  for (int t = 0; t < tx; ++t) {
    hf2q_fiber& f = fibers[t];
    f.thread = hf2q_dim3{(unsigned)t, 0u, 0u};
    f.block = hf2q_dim3{0u, 0u, 0u};
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = stacks + stack * t;
    f.uc.uc_stack.ss_size = stack;
    f.uc.uc_link = nullptr;  // a fiber switches out at its end, never returns
    makecontext(&f.uc, (void (*)())main, 1, t);
  }
  int live = tx;
  for (bool forward = true; live > 0; forward = !forward) {
    const long before = hf2q_progress;
    for (int i = 0; i < tx; ++i) {
      hf2q_fiber& f = fibers[forward ? i : tx - 1 - i];
      if (f.done) continue;
      hf2q_switch_in(&f);
      live -= f.done;
    }
    if (live > 0 && hf2q_progress == before) return false;
  }
  return true;
}
// The end of a fiber's main.
inline void hf2q_fiber_done() {
  hf2q_current->done = true;
  ++hf2q_progress;
  hf2q_switch_out();
}
static hf2q_barrier* hf2q_block_barrier = nullptr;
static std::vector<hf2q_barrier*> hf2q_warp_barriers;
static float hf2q_shfl_buf[1024];
inline void __syncthreads() { hf2q_block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
  const int t = (int)threadIdx.x, w = t / 32, l = t % 32;
  hf2q_shfl_buf[t] = v;
  hf2q_warp_barriers[w]->arrive_and_wait();
  const float r = hf2q_shfl_buf[w * 32 + (l ^ m)];
  hf2q_warp_barriers[w]->arrive_and_wait();
  return r;
}
inline float __shfl_sync(unsigned, float v, int src) {
  const int t = (int)threadIdx.x, w = t / 32;
  hf2q_shfl_buf[t] = v;
  hf2q_warp_barriers[w]->arrive_and_wait();
  const float r = hf2q_shfl_buf[w * 32 + (src & 31)];
  hf2q_warp_barriers[w]->arrive_and_wait();
  return r;
}
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
struct __nv_bfloat16 { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = uint32_t(h.bits) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return __nv_bfloat16{uint16_t(0x7FC0)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __nv_bfloat16{uint16_t(u >> 16)};
}
struct __half { _Float16 v; };
// MLX passes an input's shape/strides/ndim when the kernel source names them.
struct Shape { int32_t v[10]; int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[10]; int64_t operator[](int i) const { return v[i]; } };
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half(float f) { return __half{(_Float16)f}; }
// The GPU's bf16/fp16 add rounds the exact sum once; the float sum is that exact sum unless the
// exponents differ by more than 13 (where the rounding of the test data cannot tell).
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16(__bfloat162float(a) + __bfloat162float(b));
}
inline __half __hadd(__half a, __half b) { return __float2half(__half2float(a) + __half2float(b)); }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
// mma.sync.m16n8k16 (float32 accumulators) as the PTX ISA lays its fragments out over a warp:
// lane l = 4 g + t holds A rows g and g+8, columns 2t+{0,1} (a0, a1) and 2t+8+{0,1} (a2, a3); B
// column g, rows 2t+{0,1} (b0) and 2t+8+{0,1} (b1); C rows g (c0, c1) and g+8 (c2, c3), columns
// 2t+{0,1}. Each register packs two 16-bit values, the lower-indexed one in the low half.
#define HF2Q_EMULATED_MMA 1
static unsigned hf2q_mma_regs[1024][6];
inline float hf2q_mma_value(unsigned reg, int high, bool bf16) {
  const uint16_t bits = uint16_t(high ? reg >> 16 : reg & 0xFFFFu);
  if (bf16) return __bfloat162float(__nv_bfloat16{bits});
  _Float16 h; std::memcpy(&h, &bits, 2); return (float)h;
}
inline void hf2q_emulated_mma(bool bf16, float* c, unsigned a0, unsigned a1, unsigned a2,
                              unsigned a3, unsigned b0, unsigned b1) {
  const int t = (int)threadIdx.x, w = t / 32, l = t % 32;
  const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
  for (int i = 0; i < 6; ++i) hf2q_mma_regs[t][i] = mine[i];
  hf2q_warp_barriers[w]->arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    const int row = (l >> 2) + (e >= 2 ? 8 : 0), col = 2 * (l & 3) + (e & 1);
    float sum = 0.0f;
    for (int k = 0; k < 16; ++k) {
      const int kq = (k % 8) / 2, hi = k & 1;
      const unsigned* ra = hf2q_mma_regs[w * 32 + (row % 8) * 4 + kq];
      const unsigned* rb = hf2q_mma_regs[w * 32 + col * 4 + kq];
      const float av = hf2q_mma_value(ra[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], hi, bf16);
      const float bv = hf2q_mma_value(rb[4 + (k >= 8 ? 1 : 0)], hi, bf16);
      sum += av * bv;
    }
    c[e] += sum;
  }
  hf2q_warp_barriers[w]->arrive_and_wait();
}
"""

_CTYPES = {
    mx.float32: "float",
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.bool_: "bool",
}
_NP_VIEW = {
    mx.float32: np.float32,
    mx.bfloat16: np.uint16,
    mx.float16: np.uint16,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
    mx.int64: np.int64,
    mx.bool_: np.bool_,
}
_MX_VIEW = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16}


def compiler() -> str | None:
    """The host C++ compiler the emulator uses, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def shape_infos(source: str, names: list[str]) -> list[tuple[bool, bool, bool]]:
    """Which of ``<name>_shape``, ``_strides``, ``_ndim`` MLX passes for each input: those the
    source names (MLX decides the same way, by searching the source)."""
    return [
        (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in names
    ]


def kernel_params(
    in_names, in_dtypes, in_ndims, out_names, out_dtypes, source
) -> list[tuple[str, str]]:
    """(C++ type, name) of the kernel's parameters in MLX's order: each input and its shape
    info, then the outputs."""
    params = []
    infos = shape_infos(source, list(in_names))
    for n, d, nd, (sh, st, ndim) in zip(in_names, in_dtypes, in_ndims, infos):
        params.append((f"const {_CTYPES[d]}*", n))
        if nd > 0:
            params += [("Shape", f"{n}_shape")] if sh else []
            params += [("Strides", f"{n}_strides")] if st else []
            params += [("int", f"{n}_ndim")] if ndim else []
    params += [(f"{_CTYPES[d]}*", n) for n, d in zip(out_names, out_dtypes)]
    return params


def _template_lines(template) -> str:
    src = ""
    for tname, arg in template:
        if isinstance(arg, bool):
            src += f"  constexpr bool {tname} = {'true' if arg else 'false'};\n"
        elif isinstance(arg, int):
            src += f"  constexpr int {tname} = {arg};\n"
        else:
            src += f"  using {tname} = {_CTYPES[arg]};\n"
    return src


def _wrap(name: str, params: list[tuple[str, str]], source: str, header: str, template) -> str:
    src = PRELUDE + header + "\n"
    src += f"static void {name}(\n" + ",\n".join(f"    {t} {n}" for t, n in params) + ") {\n"
    src += _template_lines(template) + "\n" + source + "\n}\n\n"
    # Pointers are passed as they are; shape info by value from the buffer the pointer names.
    casts = [
        f"*({t}*)p[{i}]" if t in ("Shape", "Strides", "int") else f"({t})p[{i}]"
        for i, (t, _) in enumerate(params)
    ]
    src += f"""
static void** hf2q_args;
static int hf2q_grid[3];

// One fiber a thread of a block, each running every block in turn; a barrier between blocks keeps
// a block's shared memory (static arrays) to itself.
static void hf2q_fiber_main(int t) {{
  void** p = hf2q_args;
  for (int z = 0; z < hf2q_grid[2]; ++z)
    for (int y = 0; y < hf2q_grid[1]; ++y)
      for (int x = 0; x < hf2q_grid[0]; ++x) {{
        blockIdx = hf2q_dim3{{(unsigned)x, (unsigned)y, (unsigned)z}};
        {name}({", ".join(casts)});
        hf2q_block_barrier->arrive_and_wait();
      }}
  hf2q_fiber_done();
}}

extern "C" void hf2q_launch(void** p, int bx, int by, int bz, int tx) {{
  hf2q_args = p;
  hf2q_grid[0] = bx; hf2q_grid[1] = by; hf2q_grid[2] = bz;
  blockDim = hf2q_dim3{{(unsigned)tx, 1u, 1u}};
  hf2q_barrier block_barrier(tx);
  hf2q_block_barrier = &block_barrier;
  std::vector<hf2q_barrier*> warps;
  for (int w = 0; w < (tx + 31) / 32; ++w) warps.push_back(new hf2q_barrier(std::min(32, tx - 32 * w)));
  hf2q_warp_barriers = warps;
  if (!hf2q_run_fibers(tx, hf2q_fiber_main)) {{
    std::fprintf(stderr, "cuda_emu: {name} deadlocked: its threads wait at barriers no thread will reach\\n");
    std::abort();
  }}
  for (auto* w : warps) delete w;
}}
"""
    return src


#: Every program built in this process, by the hash of its whole source: tests that run the same
#: kernel with the same template arguments load it once (the build is most of their time).
_BUILT: dict[str, ctypes.CDLL] = {}

#: A folder shared by every process of a test run (tests/conftest.py sets it to the run's own
#: temporary root): a program is then built once for all pytest-xdist workers, and the one that
#: needs it second loads the first one's build. None: each kernel object's ``workdir``.
BUILD_DIR: Path | None = None

#: g++'s flags for every emulator program (the prelude's precompiled header is built with them).
_FLAGS = ["-std=c++20", "-O0", "-fPIC", "-Wno-unknown-pragmas"]


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path`` (a lock file) against the run's other processes."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(cmd: list[str], out: Path, what: str) -> None:
    """Run g++ ``cmd`` writing a temporary file, then move it to ``out`` (no half-written file is
    ever found at ``out``)."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    res = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"emulator build of {what} failed:\n{res.stderr[-4000:]}")
    os.replace(tmp, out)


def _prelude_header(folder: Path) -> Path:
    """:data:`PRELUDE` as a header in ``folder``, precompiled beside it (``.gch``) once per folder.

    Its system headers are most of an emulator program's build time (0.9 of 1.3 s at -O0); with
    ``-include`` of this header g++ reads the precompiled one instead, which holds the same
    declarations parsed with the same flags (and falls back to the text where it cannot use it).
    """
    tag = hashlib.sha1((PRELUDE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    header = folder / f"hf2q_emu_prelude_{tag}.h"
    gch = header.with_name(header.name + ".gch")
    with _locked(folder / f"{header.name}.lock"):
        if not gch.is_file():
            header.write_text(PRELUDE)
            cmd = [compiler() or "g++", *_FLAGS, "-x", "c++-header", str(header)]
            _compile(cmd, gch, "the prelude")
    return header


class EmulatedKernel:
    """Callable like ``mx.fast.cuda_kernel(...)``'s result; runs the body on the CPU."""

    def __init__(
        self,
        name: str,
        input_names: list[str],
        output_names: list[str],
        source: str,
        header: str = "",
        workdir: str | Path | None = None,
    ) -> None:
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hf2q_cuda_emu_"))

    def _lib(self, params, template) -> ctypes.CDLL:
        code = _wrap(self.name, params, self.source, self.header, template)
        key = hashlib.sha1(code.encode()).hexdigest()[:16]
        if key not in _BUILT:  # else the same program, built by this or another kernel object
            folder = BUILD_DIR or self.workdir
            folder.mkdir(parents=True, exist_ok=True)
            so = folder / f"{self.name}_{key}.so"
            with _locked(folder / f"{self.name}_{key}.lock"):
                if not so.is_file():  # else built by another process of this run
                    prelude = _prelude_header(folder)
                    cpp = folder / f"{self.name}_{key}.cpp"
                    # The program is PRELUDE + the rest; the prelude comes in by -include.
                    assert code.startswith(PRELUDE)
                    cpp.write_text(code[len(PRELUDE) :])
                    cmd = [compiler() or "g++", *_FLAGS, "-shared", "-include", str(prelude)]
                    _compile([*cmd, str(cpp)], so, self.name)
            _BUILT[key] = ctypes.CDLL(str(so))
        return _BUILT[key]

    def __call__(
        self,
        *,
        inputs: list[Any],
        output_shapes: list[tuple[int, ...]],
        output_dtypes: list[Any],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: list[tuple[str, Any]] | None = None,
        init_value: float | None = None,
        verbose: bool = False,
        stream: Any = None,
    ) -> list[mx.array]:
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        mx.eval(arrays)
        in_np = [
            np.ascontiguousarray(np.array(a.view(_MX_VIEW.get(a.dtype, a.dtype)), copy=True))
            for a in arrays
        ]
        # Poison outputs (NaN bit patterns) so that unwritten elements cannot pass a check.
        poison = {
            mx.float32: np.nan,
            mx.bfloat16: 0x7FC0,
            mx.float16: 0x7E00,
            mx.int32: -1,
            mx.int64: -1,
        }
        out_np = [
            np.full(s, poison[d] if init_value is None else init_value, dtype=_NP_VIEW[d])
            for s, d in zip(output_shapes, output_dtypes)
        ]
        params = kernel_params(
            self.input_names,
            [a.dtype for a in arrays],
            [a.ndim for a in arrays],
            self.output_names,
            list(output_dtypes),
            self.source,
        )
        lib = self._lib(params, template or [])
        buffers: list[np.ndarray] = []
        infos = shape_infos(self.source, self.input_names)
        for a, a_np, (sh, st, ndim) in zip(arrays, in_np, infos):
            buffers.append(a_np)
            if a.ndim > 0:
                pad = [0] * (10 - a.ndim)
                buffers += [np.array(list(a.shape) + pad, dtype=np.int32)] if sh else []
                strides = [s // a_np.itemsize for s in a_np.strides]
                buffers += [np.array(strides + pad, dtype=np.int64)] if st else []
                buffers += [np.array([a.ndim], dtype=np.int32)] if ndim else []
        buffers += out_np
        ptrs = (ctypes.c_void_p * len(buffers))(*[b.ctypes.data for b in buffers])
        tx, ty, tz = threadgroup
        assert ty == 1 and tz == 1, "the emulator launches 1-D thread blocks"
        blocks = [(g + t - 1) // t for g, t in zip(grid, threadgroup)]
        lib.hf2q_launch(ptrs, blocks[0], blocks[1], blocks[2], tx)
        outs = []
        for o, d in zip(out_np, output_dtypes):
            arr = mx.array(o)
            outs.append(arr.view(d) if d in _MX_VIEW else arr)
        return outs


def mlx_cuda_prelude(header: str) -> str:
    """The start of the translation unit MLX's CUDA backend builds from a ``cuda_kernel`` (for
    compile checks): the headers, then the kernel's own ``header``; :func:`mlx_cuda_kernel`
    follows. Several kernels of one header (each with its own name) can follow one prelude, to
    compile them in one ``nvcc`` run.

    MLX includes its own ``mlx/backend/cuda/device/utils.cuh`` first; the hf2q kernels need only
    the CUDA headers it pulls in (bf16/fp16 types, cooperative groups) and its ``Shape`` /
    ``Strides`` types, which stand in for it here.
    """
    src = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
    src += "#include <cuda/std/array>\n"
    src += "namespace mlx::core::cu {\nusing Shape = cuda::std::array<int32_t, 10>;\n"
    src += "using Strides = cuda::std::array<int64_t, 10>;\n}\n"
    return src + header + "\n"


def mlx_cuda_kernel(
    name: str,
    input_names: list[str],
    input_dtypes: list[Any],
    input_ndims: list[int],
    output_names: list[str],
    output_dtypes: list[Any],
    source: str,
    template: list[tuple[str, Any]],
) -> str:
    """The ``__global__`` function MLX wraps ``source`` in (after :func:`mlx_cuda_prelude`)."""
    src = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    params = kernel_params(
        input_names, input_dtypes, input_ndims, output_names, output_dtypes, source
    )
    grid_const = {"Shape", "Strides", "int"}
    src += f"__global__ void {name}(\n"
    src += ",\n".join(
        f"    const __grid_constant__ {t} {n}" if t in grid_const else f"    {t} {n}"
        for t, n in params
    )
    src += ") {\n" + _template_lines(template)
    return src + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n"
