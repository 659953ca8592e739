"""The CUDA emulator (tests/cuda_emu.py) the kernel tests rely on: barriers, warp shuffles and
shared memory behave as on a GPU with either way of switching fibers, a kernel missing a barrier
gives wrong results instead of passing by luck, and a kernel whose threads wait at barriers
others never reach ends with a message instead of hanging the test run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cuda_emu
import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(cuda_emu.compiler() is None, reason="no C++ compiler")

# Each block sums its 128 inputs: every thread's value goes through shared memory (a barrier),
# then each warp reduces its part with shuffles, and thread 0 adds the four warps' sums. A second
# output gets each thread's neighbour's value from shared memory (after the barrier).
_REDUCE = """
  __shared__ float vals[128];
  __shared__ float warp_sums[4];
  const int t = threadIdx.x, b = blockIdx.x;
  vals[t] = x[b * 128 + t];
  __syncthreads();
  next[b * 128 + t] = vals[(t + 1) % 128];
  float v = vals[t];
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (t % 32 == 0) warp_sums[t / 32] = v;
  __syncthreads();
  if (t == 0) out[b] = warp_sums[0] + warp_sums[1] + warp_sums[2] + warp_sums[3];
"""


def _run(source: str, tmp_path: Path, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    kernel = cuda_emu.EmulatedKernel("emu_reduce", ["x"], ["out", "next"], source, workdir=tmp_path)
    blocks = x.size // 128
    out, nxt = kernel(
        inputs=[mx.array(x)],
        output_shapes=[(blocks,), (x.size,)],
        output_dtypes=[mx.float32, mx.float32],
        grid=(blocks * 128, 1, 1),
        threadgroup=(128, 1, 1),
    )
    return np.array(out), np.array(nxt)


@pytest.mark.parametrize("switch", ["jump", "swapcontext"])
def test_barriers_shuffles_and_shared_memory_per_block(tmp_path, monkeypatch, switch):
    if switch == "swapcontext":
        monkeypatch.setenv("HF2Q_EMU_SWAPCONTEXT", "1")
    x = np.arange(3 * 128, dtype=np.float32)  # small integers: every float sum is exact
    out, nxt = _run(_REDUCE, tmp_path, x)
    assert out.tolist() == x.reshape(3, 128).sum(axis=1).tolist()
    assert nxt.tolist() == np.roll(x.reshape(3, 128), -1, axis=1).reshape(-1).tolist()


def test_a_missing_barrier_reads_what_is_not_yet_written(tmp_path):
    # Without the first __syncthreads a thread reads its neighbour's slot before the neighbour
    # wrote it (this block's value, not the previous block's or the poison): the emulator runs
    # the threads in turn between barriers, so the race shows every time, not by chance.
    racy = _REDUCE.replace("  __syncthreads();\n  next[", "  next[", 1)
    assert racy != _REDUCE
    x = np.arange(2 * 128, dtype=np.float32)
    _, nxt = _run(racy, tmp_path, x)
    want = np.roll(x.reshape(2, 128), -1, axis=1).reshape(-1)
    assert (nxt != want).any()


def test_threads_waiting_at_a_barrier_others_never_reach_end_the_launch(tmp_path):
    # On a GPU this kernel hangs; here the launch prints what happened and aborts the process
    # (so it runs in a child process).
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import cuda_emu, mlx.core as mx
k = cuda_emu.EmulatedKernel(
    "emu_stuck", ["x"], ["y"], "if (threadIdx.x < 16) __syncthreads(); y[threadIdx.x] = x[0];",
    workdir={str(tmp_path)!r},
)
k(inputs=[mx.zeros((1,))], output_shapes=[(32,)], output_dtypes=[mx.float32],
  grid=(32, 1, 1), threadgroup=(32, 1, 1))
print("finished")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "finished" not in res.stdout
    assert "emu_stuck deadlocked" in res.stderr
