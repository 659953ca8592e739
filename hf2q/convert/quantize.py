"""Execute a conversion plan: stream every tensor through cast and ``mx.quantize`` into the shards.

What it does: cut every planned job into row chunks (about ``chunk_bytes`` of input each). Affine,
mxfp4, nvfp4 and mxfp8 groups lie along the last axis, so quantizing row chunks gives exactly the
bytes of quantizing the whole tensor. The output shards are created up front with their final
headers, so any chunk can be written wherever it belongs as soon as it is ready. Two ways to run:

* worker processes (the default on MLX's CPU backend, where one process quantizes on one core):
  chunks of tensors that ``sanitize`` left unchanged go to ``hf2q.convert.workers``, which read
  them straight from the source file and write the pieces into the shards; the main process
  handles the few transformed tensors meanwhile;
* in process (Metal / CUDA, or one core): a reader thread ``pread``s the next chunks into a small
  pool of reusable MLX buffers, the main thread casts and quantizes, a writer thread ``pwrite``s.

Either way memory stays near a few chunks (or one transformed tensor), never the whole model.
Optionally measures each quantized weight's reconstruction error.

What it does not do: decide precisions (``hf2q.convert.plan``) or manage the output folder
(``hf2q.convert.write``).
"""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf2q.convert.plan import Job, Plan
from hf2q.convert.safetensors_io import ShardWriter, as_array, as_bytes, pread_into
from hf2q.convert.workers import WorkerPool, convert_array
from hf2q.errors import ModelError, OutputError

#: Bytes of input processed at a time for streamable tensors.
DEFAULT_CHUNK_BYTES = 32 << 20
#: Read buffers in flight in the in-process pipeline.
_POOL = 3
#: Tasks queued per worker (one running, the rest waiting: slack for a busy main process).
_PER_WORKER = 4

#: ``progress(done_bytes, total_bytes)``.
ProgressFn = Callable[[int, int], None]


@dataclass
class WriteStats:
    """What was written and the per-tensor quantization error when measured."""

    files: dict[str, list[str]] = field(default_factory=dict)  # file name -> tensor names
    weight_errors: dict[str, float] = field(default_factory=dict)  # relative RMS error per weight
    worker_peak_rss_mb: float = 0.0  # sum over worker processes of each one's peak RSS


def shard_names(plan: Plan) -> list[str]:
    n = len(plan.shards)
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class _Outputs:
    """All output files, created with their final headers; closed once complete."""

    def __init__(self, plan: Plan, folder: Path) -> None:
        self.where: dict[str, str] = {}
        layout: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
        for fname, names in zip(shard_names(plan), plan.shards):
            layout[fname] = [(n, plan.tensors[n].shape, plan.tensors[n].dtype) for n in names]
        if plan.mtp_tensors:
            layout["mtp.safetensors"] = [
                (t.name, t.shape, t.dtype) for t in plan.mtp_tensors.values()
            ]
        self.layout = layout
        self.writers: dict[str, ShardWriter] = {}
        try:
            for fname, tensors in layout.items():
                self.writers[fname] = ShardWriter(folder / fname, tensors)
                for n, _, _ in tensors:
                    self.where[n] = fname
        except BaseException:
            self.abort_all()
            raise

    def writer(self, name: str) -> ShardWriter:
        return self.writers[self.where[name]]

    def write(self, name: str, row: int, data: memoryview) -> None:
        self.writer(name).write(name, row, data)

    def close_all(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers.clear()

    def abort_all(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        self.writers.clear()


@dataclass
class _Chunk:
    job: Job
    r0: int
    r1: int
    last: bool  # the job's final chunk


def _chunks(plan: Plan, chunk_bytes: int) -> list[_Chunk]:
    out = []
    for job in plan.jobs:
        rows = job.input.rows
        row_bytes = max(1, job.input.nbytes // max(1, rows))
        step = max(1, chunk_bytes // row_bytes)
        starts = list(range(0, rows, step)) or [0]
        for i, r0 in enumerate(starts):
            out.append(_Chunk(job, r0, min(rows, r0 + step), i == len(starts) - 1))
    return out


def _spec(job: Job) -> tuple[int, int, str] | None:
    s = job.spec
    return None if s is None else (s.bits, s.group_size, s.mode)


class _Lazy:
    """Inputs ``sanitize`` transformed: materialised once per group, then cut into chunks."""

    def __init__(self, jobs: list[Job]) -> None:
        self.groups: dict[str, list[Job]] = {}
        for job in jobs:
            if job.input.array is not None:
                self.groups.setdefault(job.input.group, []).append(job)
        self.flat: dict[int, Any] = {}

    def rows(self, c: _Chunk) -> Any:
        import mlx.core as mx

        inp = c.job.input
        flat = self.flat.get(id(c.job))
        if flat is None:
            # Inputs sharing a source (gate/up of one fused expert tensor) are computed together.
            members = [
                j.input.array for j in self.groups.pop(inp.group, []) if j.input.array is not None
            ]
            if members:
                mx.eval(*members)
            arr = inp.array
            flat = arr.reshape(inp.rows, inp.shape[-1]) if len(inp.shape) > 1 else arr
            self.flat[id(c.job)] = flat
        x = flat[c.r0 : c.r1] if len(inp.shape) > 1 else flat
        if c.last:
            self.flat.pop(id(c.job), None)
            inp.array = None  # free it once its last chunk is out
        return x


def _pieces(c: _Chunk, converted: list[Any]) -> list[tuple[str, int, memoryview]]:
    x = converted
    if len(c.job.input.shape) == 0:
        x = [converted[0].reshape(())]
    return [(name, c.r0, as_bytes(part)) for name, part in zip(c.job.outputs, x, strict=True)]


def write_weights(
    plan: Plan,
    folder: Path,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    measure_error: bool = False,
    progress: ProgressFn | None = None,
    workers: WorkerPool | int = 0,
) -> WriteStats:
    """Write all planned tensors into ``folder`` (shards named like mlx-lm's, plus mtp.safetensors).

    Args:
        workers: a running :class:`WorkerPool`, or how many worker processes to start for this
            call (0: everything in this process).
    """
    import mlx.core as mx

    outputs = _Outputs(plan, folder)
    stats = WriteStats(files={f: [n for n, _, _ in t] for f, t in outputs.layout.items()})
    chunks = _chunks(plan, chunk_bytes)
    errors: dict[str, list[float]] = {}
    total = sum(j.input.nbytes for j in plan.jobs) or 1
    done = [0]

    def account(c: _Chunk, err: tuple[float, float] | None) -> None:
        if err is not None and c.job.spec is not None and measure_error:
            acc = errors.setdefault(c.job.name, [0.0, 0.0])
            acc[0] += err[0]
            acc[1] += err[1]
        inp = c.job.input
        done[0] += (c.r1 - c.r0) * max(1, inp.nbytes // max(1, inp.rows))
        if progress is not None:
            progress(min(done[0], total), total)

    own_pool = isinstance(workers, int) and workers > 0
    pool = WorkerPool(workers) if own_pool else workers
    old_limit = mx.set_cache_limit(4 * chunk_bytes)
    try:
        if isinstance(pool, WorkerPool) and len(pool):
            stats.worker_peak_rss_mb = _run_with_workers(
                pool, chunks, outputs, measure_error, account
            )
        else:
            _run_in_process(chunks, outputs, plan, measure_error, account)
        outputs.close_all()
    except BaseException:
        outputs.abort_all()
        if own_pool:
            pool.close(force=True)
            own_pool = False
        raise
    finally:
        if own_pool:
            pool.close()
        mx.set_cache_limit(old_limit)
        mx.clear_cache()
    for name, (e2, r2) in errors.items():
        stats.weight_errors[name] = math.sqrt(e2 / r2) if r2 > 0 else 0.0
    return stats


def _run_with_workers(
    pool: WorkerPool,
    chunks: list[_Chunk],
    outputs: _Outputs,
    measure_error: bool,
    account: Callable[[_Chunk, tuple[float, float] | None], None],
) -> float:
    """Streamable chunks go to the worker processes; transformed ones run here meanwhile.

    Returns the sum of the workers' peak RSS in MB.
    """
    from multiprocessing.connection import wait

    import mlx.core as mx

    tasks: deque[tuple[int, Any]] = deque()
    local: list[_Chunk] = []
    for i, c in enumerate(chunks):
        info = c.job.input.info
        if info is None:
            local.append(c)
            continue
        nbytes = (c.r1 - c.r0) * info.row_bytes
        shape = (c.r1 - c.r0, info.shape[-1]) if len(info.shape) > 1 else info.shape
        dests = []
        for name in c.job.outputs:
            writer = outputs.writer(name)
            size = (c.r1 - c.r0) * writer.row_bytes(name)
            dests.append((str(writer.path), writer.region(name, c.r0, size), size))
        out_dtype = str(c.job.out_dtype).split(".")[-1] if c.job.out_dtype is not None else None
        task = (
            i,
            str(info.file),
            info.start + c.r0 * info.row_bytes,
            nbytes,
            info.dtype,
            shape,
            out_dtype,
            _spec(c.job),
            dests,
            measure_error,
        )
        tasks.append((i, task))
    inflight: dict[Any, int] = {conn: 0 for conn in pool.conns}
    peaks: dict[Any, int] = {conn: 0 for conn in pool.conns}
    sent: dict[int, tuple[_Chunk, list[tuple[str, int, int]]]] = {}

    def pump() -> None:
        for conn in pool.conns:
            while tasks and inflight[conn] < _PER_WORKER:
                i, task = tasks.popleft()
                conn.send(task)
                sent[i] = (chunks[i], task[8])
                inflight[conn] += 1

    def collect(timeout: float) -> None:
        for conn in wait(pool.conns, timeout=timeout):
            try:
                idx, failure, err = conn.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError("a quantization worker died unexpectedly") from exc
            inflight[conn] -= 1
            c, dests = sent.pop(idx)
            if failure is not None:
                kind, message = failure
                if kind == "output":
                    raise OutputError(
                        f"cannot write the output ({message}): check free space and permissions"
                    )
                if kind == "model":
                    raise ModelError(message)
                raise RuntimeError(f"quantization worker failed: {message}")
            for name, (_, _, size) in zip(c.job.outputs, dests, strict=True):
                outputs.writer(name).mark_written(name, size)
            peaks[conn] = max(peaks[conn], err[2])
            account(c, err[:2])

    lazy = _Lazy([c.job for c in local])
    pump()
    for c in local:
        x = lazy.rows(c)
        out = convert_array(x, c.job.out_dtype, _spec(c.job), measure_error)
        for name, row, data in _pieces(c, out.pieces):
            outputs.write(name, row, data)
        account(c, (out.err2, out.ref2))
        collect(0)
        pump()
        del x, out
        mx.clear_cache()
    while tasks or any(inflight.values()):
        collect(0.5)
        pump()
    return sum(peaks.values()) / (1 << 20 if sys.platform == "darwin" else 1 << 10)


class _Stop(Exception):
    """Raised inside helper threads when the main thread gives up."""


def _get(q: queue.Queue[Any], stop: threading.Event) -> Any:
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():
                raise _Stop from None


def _next(q: queue.Queue[Any], errors: list[BaseException]) -> Any:
    """The next item for the main thread, or the writer's error as soon as there is one."""
    while True:
        if errors:
            raise errors[0]
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            continue


def _run_in_process(
    chunks: list[_Chunk],
    outputs: _Outputs,
    plan: Plan,
    measure_error: bool,
    account: Callable[[_Chunk, tuple[float, float] | None], None],
) -> None:
    """Reader thread -> MLX on this thread -> writer thread (only this thread calls MLX)."""
    import mlx.core as mx

    biggest = max(
        [(c.r1 - c.r0) * c.job.input.info.row_bytes for c in chunks if c.job.input.info] or [0]
    )
    # Host buffers (CPU stream): the reader thread writes into their memory directly.
    pool = [mx.zeros((max(1, biggest),), dtype=mx.uint8, stream=mx.cpu) for _ in range(_POOL)]
    mx.eval(pool)
    views = [memoryview(b) for b in pool]
    free: queue.Queue[int] = queue.Queue()
    for i in range(_POOL):
        free.put(i)
    ready: queue.Queue[Any] = queue.Queue()
    to_write: queue.Queue[Any] = queue.Queue(maxsize=2 * _POOL)
    written: queue.Queue[Any] = queue.Queue()  # finished items, released on the main thread
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        fds: dict[Path, int] = {}
        try:
            for c in chunks:
                info = c.job.input.info
                if info is None:
                    ready.put((c, None))
                    continue
                slot = _get(free, stop)
                fd = fds.get(info.file)
                if fd is None:
                    fd = fds[info.file] = os.open(info.file, os.O_RDONLY)
                nbytes = (c.r1 - c.r0) * info.row_bytes
                offset = info.start + c.r0 * info.row_bytes
                pread_into(fd, views[slot][:nbytes], offset, info.file, info.name)
                ready.put((c, slot))
        except _Stop:
            pass
        except BaseException as exc:  # surfaced on the main thread
            ready.put(exc)
        finally:
            for fd in fds.values():
                os.close(fd)

    def writer() -> None:
        try:
            while True:
                item = _get(to_write, stop)
                if item is None:
                    return
                pieces, slot = item
                for name, row, data in pieces:
                    outputs.write(name, row, data)
                if slot is not None:
                    free.put(slot)
                written.put(item)
        except _Stop:
            pass
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=reader, daemon=True),
        threading.Thread(target=writer, daemon=True),
    ]
    for t in threads:
        t.start()
    lazy = _Lazy(plan.jobs)
    try:
        for _ in range(len(chunks)):
            item = _next(ready, errors)
            if isinstance(item, BaseException):
                raise item
            c, slot = item
            inp = c.job.input
            if slot is not None:
                raw = pool[slot][: (c.r1 - c.r0) * inp.info.row_bytes]
                x = as_array(raw, inp.info, c.r1 - c.r0)
            else:
                x = lazy.rows(c)
            out = convert_array(x, c.job.out_dtype, _spec(c.job), measure_error)
            item = (_pieces(c, out.pieces), slot)
            while True:
                try:
                    to_write.put(item, timeout=0.1)
                    break
                except queue.Full:
                    if errors:
                        raise errors[0] from None
            while not written.empty():
                written.get_nowait()  # drop the arrays behind finished writes here, on this thread
            account(c, (out.err2, out.ref2))
        while True:
            try:
                to_write.put(None, timeout=0.1)
                break
            except queue.Full:
                if errors:
                    raise errors[0] from None
        threads[1].join()
        if errors:
            raise errors[0]
    except BaseException:
        stop.set()
        raise
    finally:
        for t in threads:
            t.join()
        while not written.empty():
            written.get_nowait()
        views.clear()
        pool.clear()
