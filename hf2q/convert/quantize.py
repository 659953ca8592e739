"""Execute a conversion plan: stream every tensor through cast and ``mx.quantize`` into the shards.

What it does: cut every planned job into row chunks (about ``chunk_bytes`` of input each) and run
them through a three-stage pipeline: a reader thread ``pread``s the next chunks of tensors that
``sanitize`` left unchanged straight into a small pool of reusable MLX buffers; the main thread
casts and quantizes (affine / mxfp4 / nvfp4 / mxfp8 groups lie along the last axis, so quantizing
row chunks gives exactly the bytes of quantizing the whole tensor); a writer thread ``pwrite``s
the results into pre-laid-out shard files. Reading and writing overlap the quantization, and
memory stays near a few chunks (or one transformed tensor, for the few that ``sanitize`` rewrites),
never the whole model. Optionally measures each quantized weight's reconstruction error.

Only the main thread calls MLX; the helper threads move bytes between files and buffers whose
arrays the main thread keeps alive until the bytes are done with.

What it does not do: decide precisions (``hf2q.convert.plan``) or manage the output folder
(``hf2q.convert.write``).
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf2q.convert.plan import Job, Plan
from hf2q.convert.safetensors_io import ShardWriter, as_array, as_bytes, pread_into

#: Bytes of input processed at a time for streamable tensors.
DEFAULT_CHUNK_BYTES = 32 << 20
#: Read buffers in flight (the reader runs at most this many chunks ahead).
_POOL = 3

#: ``progress(done_bytes, total_bytes)``.
ProgressFn = Callable[[int, int], None]


@dataclass
class WriteStats:
    """What was written and the per-tensor quantization error when measured."""

    files: dict[str, list[str]] = field(default_factory=dict)  # file name -> tensor names
    weight_errors: dict[str, float] = field(default_factory=dict)  # relative RMS error per weight


def shard_names(plan: Plan) -> list[str]:
    n = len(plan.shards)
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class _Outputs:
    """Shard writers opened on first write and closed once all their tensors are complete."""

    def __init__(self, plan: Plan, folder: Path) -> None:
        self.folder = folder
        self.where: dict[str, str] = {}
        self.layout: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
        for fname, names in zip(shard_names(plan), plan.shards):
            self.layout[fname] = [(n, plan.tensors[n].shape, plan.tensors[n].dtype) for n in names]
            for n in names:
                self.where[n] = fname
        if plan.mtp_tensors:
            self.layout["mtp.safetensors"] = [
                (t.name, t.shape, t.dtype) for t in plan.mtp_tensors.values()
            ]
            for n in plan.mtp_tensors:
                self.where[n] = "mtp.safetensors"
        self.open: dict[str, ShardWriter] = {}
        self.pending = {f: {n for n, _, _ in tensors} for f, tensors in self.layout.items()}

    def write(self, name: str, row: int, data: memoryview) -> None:
        fname = self.where[name]
        writer = self.open.get(fname)
        if writer is None:
            writer = self.open[fname] = ShardWriter(self.folder / fname, self.layout[fname])
        writer.write(name, row, data)

    def finished(self, name: str) -> None:
        fname = self.where[name]
        pending = self.pending[fname]
        pending.discard(name)
        if not pending:
            if fname not in self.open:  # a shard holding only empty tensors
                self.open[fname] = ShardWriter(self.folder / fname, self.layout[fname])
            self.open.pop(fname).close()

    def abort_all(self) -> None:
        for writer in self.open.values():
            writer.abort()
        self.open.clear()


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


class _Stop(Exception):
    """Raised inside helper threads when the main thread gives up."""


def _get(q: queue.Queue[Any], stop: threading.Event) -> Any:
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if stop.is_set():
                raise _Stop from None


def write_weights(
    plan: Plan,
    folder: Path,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    measure_error: bool = False,
    progress: ProgressFn | None = None,
) -> WriteStats:
    """Write all planned tensors into ``folder`` (shards named like mlx-lm's, plus mtp.safetensors)."""
    import mlx.core as mx

    outputs = _Outputs(plan, folder)
    stats = WriteStats(files={f: [n for n, _, _ in t] for f, t in outputs.layout.items()})
    chunks = _chunks(plan, chunk_bytes)
    total = sum(j.input.nbytes for j in plan.jobs) or 1

    # Read buffers: MLX arrays the main thread owns; the reader fills them through memoryviews.
    biggest = max(
        [(c.r1 - c.r0) * (c.job.input.info.row_bytes) for c in chunks if c.job.input.info] or [0]
    )
    pool = [mx.zeros((max(1, biggest),), dtype=mx.uint8) for _ in range(_POOL)]
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
                pread_into(fd, views[slot][:nbytes], info.start + c.r0 * info.row_bytes, info)
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
                pieces, slot, finished = item
                for name, row, data in pieces:
                    outputs.write(name, row, data)
                for name in finished:
                    outputs.finished(name)
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
    old_limit = mx.set_cache_limit(4 * chunk_bytes)
    done = 0
    lazy_flat: dict[int, Any] = {}
    groups: dict[str, list[Job]] = {}
    for job in plan.jobs:
        if job.input.array is not None:
            groups.setdefault(job.input.group, []).append(job)
    err_acc: dict[str, list[float]] = {}
    try:
        for _ in range(len(chunks)):
            item = _next(ready, errors)
            if isinstance(item, BaseException):
                raise item
            c, slot = item
            job, inp = c.job, c.job.input
            if slot is not None:
                x = as_array(
                    pool[slot][: (c.r1 - c.r0) * inp.info.row_bytes], inp.info, c.r1 - c.r0
                )
            else:
                flat = lazy_flat.get(id(job))
                if flat is None:
                    # Materialise transformed inputs sharing a source once (e.g. a fused gate_up).
                    members = [
                        j.input.array
                        for j in groups.pop(inp.group, [])
                        if j.input.array is not None
                    ]
                    if members:
                        mx.eval(*members)
                    arr = inp.array
                    flat = arr.reshape(inp.rows, inp.shape[-1]) if len(inp.shape) > 1 else arr
                    lazy_flat[id(job)] = flat
                x = flat[c.r0 : c.r1] if len(inp.shape) > 1 else flat
            pieces = _convert_chunk(job, x, c.r0, measure_error, err_acc)
            if c.last:
                lazy_flat.pop(id(job), None)
                inp.array = None
            to_write_item = (pieces, slot, job.outputs if c.last else [])
            while True:
                try:
                    to_write.put(to_write_item, timeout=0.1)
                    break
                except queue.Full:
                    if errors:
                        raise errors[0] from None
            while not written.empty():
                written.get_nowait()  # drop the arrays behind finished writes here, on this thread
            done += (c.r1 - c.r0) * max(1, inp.nbytes // max(1, inp.rows))
            if progress is not None:
                progress(min(done, total), total)
        _put_end(to_write, errors)
        threads[1].join()
        if errors:
            raise errors[0]
    except BaseException:
        stop.set()
        for t in threads:
            t.join()
        outputs.abort_all()
        raise
    finally:
        threads[0].join()
        while not written.empty():
            written.get_nowait()
        mx.set_cache_limit(old_limit)
        views.clear()
        pool.clear()
        mx.clear_cache()
    for name, (e2, r2) in err_acc.items():
        stats.weight_errors[name] = math.sqrt(e2 / r2) if r2 > 0 else 0.0
    return stats


def _next(q: queue.Queue[Any], errors: list[BaseException]) -> Any:
    """The next item for the main thread, or the writer's error as soon as there is one."""
    while True:
        if errors:
            raise errors[0]
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            continue


def _put_end(q: queue.Queue[Any], errors: list[BaseException]) -> None:
    while True:
        try:
            q.put(None, timeout=0.1)
            return
        except queue.Full:
            if errors:
                return


def _convert_chunk(
    job: Job, x: Any, row: int, measure_error: bool, err_acc: dict[str, list[float]]
) -> list[tuple[str, int, memoryview]]:
    """Cast / quantize one chunk; return ``(tensor, first_row, bytes)`` pieces to write."""
    import mlx.core as mx

    if job.out_dtype is not None and x.dtype != job.out_dtype:
        x = x.astype(job.out_dtype)
    if len(job.input.shape) == 0:
        x = x.reshape(())
    spec = job.spec
    if spec is None:
        mx.eval(x)
        return [(job.outputs[0], row, as_bytes(x))]
    packed = mx.quantize(x, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    if measure_error:
        back = mx.dequantize(
            *packed[:2],
            biases=packed[2] if len(packed) > 2 else None,
            group_size=spec.group_size,
            bits=spec.bits,
            mode=spec.mode,
        ).astype(mx.float32)
        xf = x.astype(mx.float32)
        e, r = mx.sum(mx.square(back - xf)), mx.sum(mx.square(xf))
        mx.eval(packed, e, r)
        acc = err_acc.setdefault(job.name, [0.0, 0.0])
        acc[0] += e.item()
        acc[1] += r.item()
    else:
        mx.eval(packed)
    return [(name, row, as_bytes(part)) for name, part in zip(job.outputs, packed)]
