"""Quantization worker processes: more CPU cores for ``mx.quantize`` on MLX's CPU backend.

MLX's CPU backend runs an operation on one core, and two threads (or two streams) of one process
do not overlap, so the only way to use a second core is a second process. Each worker is a small
spawned Python process that imports only ``mlx.core``; it receives chunk tasks over a pipe (read
these bytes of the source file, cast, quantize, write the pieces at these offsets of the output
shards, which the parent created with their final headers), and answers with the measured error.
Workers ignore Ctrl-C (the parent stops them) and exit when the parent goes away (their pipe
reaches EOF), so a killed conversion leaves no stray processes.

What it does not do: plan anything or touch files other than the ones named in a task.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from typing import Any

#: A task: (id, src file, src offset, nbytes, src dtype tag, shape of the chunk, out dtype name or
#: None, (bits, group_size, mode) or None, destinations [(file, offset, nbytes)], measure error).
Task = tuple[
    int,
    str,
    int,
    int,
    str,
    tuple[int, ...],
    "str | None",
    "tuple[int, int, str] | None",
    list[tuple[str, int, int]],
    bool,
]


#: Rows between two rows whose quantization error is measured.
ERROR_STRIDE = 16


@dataclass
class Converted:
    """The pieces produced from one chunk and, when measured, its squared error and norm."""

    pieces: list[Any]  # MLX arrays, evaluated: [x] or [weight, scales(, biases)]
    err2: float = 0.0
    ref2: float = 0.0


def convert_array(
    x: Any, out_dtype: Any, spec: tuple[int, int, str] | None, measure: bool
) -> Converted:
    """Cast ``x`` to ``out_dtype`` (if given) and quantize it with ``spec`` (if given); evaluate."""
    import mlx.core as mx

    if out_dtype is not None and x.dtype != out_dtype:
        x = x.astype(out_dtype)
    if spec is None:
        mx.eval(x)
        return Converted([x])
    bits, group_size, mode = spec
    packed = mx.quantize(x, group_size=group_size, bits=bits, mode=mode)
    if not measure:
        mx.eval(packed)
        return Converted(list(packed))
    # The error is estimated on every ERROR_STRIDE-th row: the full measurement would cost
    # several times the quantization itself on a CPU.
    step = ERROR_STRIDE if x.ndim > 1 and x.shape[0] >= 4 * ERROR_STRIDE else 1
    rows = (slice(None, None, step),) if x.ndim > 1 else (slice(None),)
    back = mx.dequantize(
        packed[0][rows],
        packed[1][rows],
        packed[2][rows] if len(packed) > 2 else None,
        group_size=group_size,
        bits=bits,
        mode=mode,
        dtype=mx.float32,
    )
    xf = x[rows].astype(mx.float32)
    e, r = mx.sum(mx.square(back - xf)), mx.sum(mx.square(xf))
    mx.eval(packed, e, r)
    return Converted(list(packed), e.item(), r.item())


def worker_main(conn: Any, cache_bytes: int) -> None:
    """Serve tasks from ``conn`` until it sends None or the parent disappears."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    import resource  # POSIX only, like the workers themselves

    import mlx.core as mx

    from hf2q.convert.safetensors_io import as_bytes, pread_into, pwrite_all, view_as

    mx.set_cache_limit(cache_bytes)  # recycled buffers keep their pages: no fresh page faults
    inputs: dict[str, int] = {}
    outputs: dict[str, int] = {}
    buffer: Any = None
    view: memoryview | None = None
    try:
        while True:
            try:
                task = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if task is None:
                return
            idx, src, offset, nbytes, tag, shape, out_dtype, spec, dests, measure = task
            try:
                if buffer is None or buffer.size < nbytes:
                    # One read buffer, reused: the previous task is fully written before the
                    # next read, and fresh pages cost more than the copy itself.
                    buffer = mx.zeros((nbytes,), dtype=mx.uint8, stream=mx.cpu)
                    mx.eval(buffer)
                    view = memoryview(buffer)
                raw = buffer[:nbytes] if buffer.size > nbytes else buffer
                try:
                    fd = inputs.get(src)
                    if fd is None:
                        fd = inputs[src] = os.open(src, os.O_RDONLY)
                    pread_into(fd, view[:nbytes], offset, src, f"bytes {offset}..{offset + nbytes}")
                except OSError as exc:
                    conn.send((idx, ("model", f"cannot read {src} ({exc.strerror or exc})"), None))
                    continue
                x = view_as(raw, tag, shape)
                out = convert_array(x, getattr(mx, out_dtype) if out_dtype else None, spec, measure)
                out_err = (out.err2, out.ref2)
                for piece, (path, at, size) in zip(out.pieces, dests, strict=True):
                    data = as_bytes(piece)
                    if data.nbytes != size:
                        raise RuntimeError(
                            f"piece of {size} bytes expected, {data.nbytes} produced"
                        )
                    wfd = outputs.get(path)
                    if wfd is None:
                        wfd = outputs[path] = os.open(path, os.O_WRONLY)
                    pwrite_all(wfd, data, at)
                del x, out, raw, data
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                conn.send((idx, None, (out_err[0], out_err[1], peak)))
            except OSError as exc:
                conn.send((idx, ("output", f"{exc.strerror or exc}"), None))
            except Exception as exc:
                kind = "model" if type(exc).__name__ == "ModelError" else "bug"
                conn.send((idx, (kind, f"{type(exc).__name__}: {exc}"), None))
    finally:
        for fd in list(inputs.values()) + list(outputs.values()):
            os.close(fd)


class WorkerPool:
    """``n`` worker processes, each connected by a socket pair; stopped by :meth:`close`.

    Workers are started as ``python -m hf2q.convert.workers FD CACHE`` rather than through
    multiprocessing's spawn, which re-imports the caller's ``__main__`` (breaking scripts read
    from stdin and re-running unguarded ones).
    """

    def __init__(self, n: int, *, cache_bytes: int = 128 << 20) -> None:
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection
        from pathlib import Path

        import hf2q

        env = dict(os.environ)
        # The child must import this same hf2q, wherever the parent found it.
        root = str(Path(hf2q.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        try:
            for _ in range(n):
                ours, theirs = socket.socketpair()
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "hf2q.convert.workers",
                        str(theirs.fileno()),
                        str(cache_bytes),
                    ],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env=env,
                )
                theirs.close()  # only the worker holds its end: our death is its EOF
                self.procs.append(proc)
                self.conns.append(Connection(ours.detach()))
        except BaseException:
            self.close(force=True)
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def close(self, *, force: bool = False) -> None:
        """Stop the workers (politely, or at once with ``force``) and reap them."""
        import subprocess

        for conn in self.conns:
            if not force:
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self.procs:
            if force:
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def default_workers() -> int:
    """Worker processes to use: one per available core on MLX's CPU backend (at most 8), else 0.

    On Metal or CUDA the device quantizes far faster than the host could feed more processes.
    """
    import mlx.core as mx

    if os.name != "posix" or mx.default_device() != mx.cpu:
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(0, min(8, cores)) if cores > 1 else 0


if __name__ == "__main__":
    import sys
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # before anything slow: Ctrl-C is the parent's
    worker_main(Connection(int(sys.argv[1])), int(sys.argv[2]))
