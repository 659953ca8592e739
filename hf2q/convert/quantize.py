"""Execute a conversion plan: stream every tensor through cast and ``mx.quantize`` into the shards.

What it does: for each planned job read the input in row chunks (straight from the source file
when ``sanitize`` left the tensor unchanged; otherwise the lazily transformed array, materialised
once), cast it, quantize it (affine / mxfp4 / nvfp4 / mxfp8 groups lie along the last axis, so
quantizing row chunks gives exactly the bytes of quantizing the whole tensor), and write the
pieces into pre-laid-out shard files. Memory stays near one chunk (or one transformed tensor),
never the whole model. Optionally measures each quantized weight's reconstruction error.

What it does not do: decide precisions (``hf2q.convert.plan``) or manage the output folder
(``hf2q.convert.write``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf2q.convert.plan import Job, Plan
from hf2q.convert.safetensors_io import ShardWriter, read_rows

#: Bytes of input read and processed at a time for streamable tensors.
DEFAULT_CHUNK_BYTES = 64 << 20

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

    def write(self, name: str, row: int, array: Any) -> None:
        fname = self.where[name]
        writer = self.open.get(fname)
        if writer is None:
            writer = ShardWriter(self.folder / fname, self.layout[fname])
            self.open[fname] = writer
        writer.write(name, row, array)

    def finished(self, name: str) -> None:
        fname = self.where[name]
        pending = self.pending[fname]
        pending.discard(name)
        if not pending:
            if fname not in self.open:  # a shard of empty tensors only
                self.open[fname] = ShardWriter(self.folder / fname, self.layout[fname])
            self.open.pop(fname).close()

    def abort_all(self) -> None:
        for writer in self.open.values():
            writer.abort()
        self.open.clear()


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
    total = sum(j.input.nbytes for j in plan.jobs) or 1
    done = 0
    fds: dict[Path, int] = {}
    groups: dict[str, list[Job]] = {}
    for job in plan.jobs:
        if job.input.array is not None:
            groups.setdefault(job.input.group, []).append(job)
    old_limit = mx.set_cache_limit(2 * chunk_bytes)
    try:
        for job in plan.jobs:
            inp = job.input
            if inp.array is not None:
                # Materialise transformed inputs sharing a source once (e.g. a fused gate_up).
                members = [
                    j.input.array for j in groups.pop(inp.group, []) if j.input.array is not None
                ]
                if members:
                    mx.eval(*members)
            err = _run_job(job, outputs, fds, chunk_bytes, measure_error)
            if err is not None:
                stats.weight_errors[job.name] = err
            inp.array = None  # free it
            for name in job.outputs:
                outputs.finished(name)
            done += inp.nbytes
            if progress is not None:
                progress(done, total)
            mx.clear_cache()
    except BaseException:
        outputs.abort_all()
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
        mx.set_cache_limit(old_limit)
    return stats


def _run_job(
    job: Job,
    outputs: _Outputs,
    fds: dict[Path, int],
    chunk_bytes: int,
    measure_error: bool,
) -> float | None:
    import mlx.core as mx

    inp = job.input
    rows = inp.rows
    row_bytes = max(1, inp.nbytes // max(1, rows))
    step = max(1, chunk_bytes // row_bytes)
    flat = None
    if inp.array is not None:
        flat = inp.array.reshape(rows, inp.shape[-1]) if len(inp.shape) > 1 else inp.array
    err2 = ref2 = 0.0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if inp.info is not None:
            fd = fds.get(inp.info.file)
            if fd is None:
                fd = fds[inp.info.file] = os.open(inp.info.file, os.O_RDONLY)
            x = read_rows(inp.info, r0, r1, fd)
        else:
            x = flat[r0:r1] if len(inp.shape) > 1 else flat
        if job.out_dtype is not None and x.dtype != job.out_dtype:
            x = x.astype(job.out_dtype)
        if job.spec is None:
            if len(inp.shape) == 0:
                x = x.reshape(())
            mx.eval(x)
            outputs.write(job.outputs[0], r0, x)
            continue
        spec = job.spec
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
            err2 += e.item()
            ref2 += r.item()
        else:
            mx.eval(packed)
        for name, part in zip(job.outputs, packed):
            outputs.write(name, r0, part)
    if job.spec is not None and measure_error:
        return math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
    return None
