"""Streaming safetensors I/O: read headers and row ranges, write shards piece by piece.

What it does: parse a safetensors header without touching the data (and refuse truncated files),
read any range of rows of a stored tensor with ``pread`` (so a 1 GB embedding can be processed
64 MB at a time), and write shard files whose header is fixed up front so tensors can be filled in
any order, in row chunks, without holding a whole shard in memory.

What it does not do: decide what to write (see ``hf2q.convert.plan``) or know model names.
Format: 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets}}`` (+ ``__metadata__``), then the raw little-endian row-major data.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from hf2q.errors import ModelError, OutputError

#: safetensors dtype tag -> (numpy dtype used to carry the bytes, MLX dtype name, bytes per item)
_DTYPES: dict[str, tuple[str, str, int]] = {
    "BF16": ("uint16", "bfloat16", 2),
    "F16": ("float16", "float16", 2),
    "F32": ("float32", "float32", 4),
    "F64": ("float64", "float64", 8),
    "U8": ("uint8", "uint8", 1),
    "I8": ("int8", "int8", 1),
    "U16": ("uint16", "uint16", 2),
    "I16": ("int16", "int16", 2),
    "U32": ("uint32", "uint32", 4),
    "I32": ("int32", "int32", 4),
    "U64": ("uint64", "uint64", 8),
    "I64": ("int64", "int64", 8),
    "BOOL": ("bool", "bool_", 1),
}
_MLX_TO_TAG = {mlx_name: tag for tag, (_, mlx_name, _) in _DTYPES.items() if tag != "U16"} | {
    "uint16": "U16"
}

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    file: Path
    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def readable(self) -> bool:
        """True when rows of this tensor can be read directly (a dtype MLX and numpy share)."""
        return self.dtype in _DTYPES

    @property
    def rows(self) -> int:
        """Number of rows when viewed as 2-D (leading dims flattened; a 1-D tensor is one row)."""
        return prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows if self.rows else 0


def read_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse ``file``'s header; raise :class:`ModelError` naming the fix if it is damaged.

    Returns:
        ``(tensors, metadata)``: tensor name -> :class:`TensorInfo`, and ``__metadata__``.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelError(
                    f"{file} is truncated ({size} bytes): the download is incomplete, re-download it"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelError(
                    f"{file} is truncated or not a safetensors file (header of {n} bytes, file of "
                    f"{size}): re-download it"
                )
            raw = json.loads(fh.read(n))
    except OSError as exc:
        raise ModelError(f"{file} cannot be read ({exc.strerror or exc}): check the file") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{file} has a damaged header (not valid JSON): re-download it") from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{file} has a damaged header: re-download it")
    metadata = raw.pop("__metadata__", None) or {}
    base = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(
                f"{file} has a damaged header entry for {name}: re-download it"
            ) from exc
        if base + end > size or end < begin:
            raise ModelError(
                f"{file} is truncated: tensor {name} ends at byte {base + end} but the file has "
                f"{size} bytes; the download is incomplete, re-download it"
            )
        tensors[name] = TensorInfo(file, name, dtype, shape, base + begin, end - begin)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def pread_into(fd: int, view: memoryview, offset: int, file: Any, name: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset`` (loops over short reads; releases the GIL)."""
    done, count = 0, view.nbytes
    while done < count:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ModelError(f"{file} ended early while reading {name}: re-download it")
        done += got


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (loops over short writes)."""
    done, count = 0, data.nbytes
    while done < count:
        done += os.pwrite(fd, data[done:], offset + done)


def view_as(raw: Any, tag: str, shape: tuple[int, ...]) -> Any:
    """View raw bytes (an MLX uint8 array) as safetensors dtype ``tag`` with ``shape``."""
    import mlx.core as mx

    return raw.view(getattr(mx, _DTYPES[tag][1])).reshape(shape)


def as_array(raw: Any, info: TensorInfo, rows: int) -> Any:
    """View the raw bytes (an MLX uint8 array) of ``rows`` rows of ``info`` as its dtype and shape."""
    shape = (rows, info.shape[-1]) if len(info.shape) > 1 else info.shape
    return view_as(raw, info.dtype, shape)


def read_rows(info: TensorInfo, start: int, stop: int, fd: int | None = None) -> Any:
    """Rows ``[start, stop)`` of a stored tensor (2-D view) as an MLX array of its dtype.

    The result has shape ``(stop - start, shape[-1])`` (1-D tensors: the whole vector). The bytes
    are read straight into MLX's buffer (no intermediate copy).
    """
    import mlx.core as mx

    count = (stop - start) * info.row_bytes
    raw = mx.zeros((count,), dtype=mx.uint8, stream=mx.cpu)  # host memory, filled by pread
    mx.eval(raw)
    own = fd is None
    if own:
        fd = os.open(info.file, os.O_RDONLY)
    try:
        if count:
            pread_into(
                fd, memoryview(raw), info.start + start * info.row_bytes, info.file, info.name
            )
    finally:
        if own:
            os.close(fd)
    return as_array(raw, info, stop - start)


def read_tensor(info: TensorInfo) -> Any:
    """The whole stored tensor as an MLX array of its shape and dtype."""
    arr = read_rows(info, 0, info.rows)
    return arr.reshape(info.shape)


def dtype_tag(dtype: Any) -> str:
    """safetensors tag of an MLX dtype (``mx.bfloat16`` -> ``"BF16"``)."""
    name = str(dtype).split(".")[-1]
    try:
        return _MLX_TO_TAG[name]
    except KeyError as exc:  # pragma: no cover - every dtype hf2q writes is listed
        raise ValueError(f"no safetensors dtype for {dtype}") from exc


@dataclass
class _Slot:
    start: int
    nbytes: int
    row_bytes: int
    written: int = 0


class ShardWriter:
    """One safetensors file whose layout is fixed at creation; tensors are filled by row ranges.

    Usage: ``w = ShardWriter(path, [(name, shape, dtype_tag), ...])``, then ``w.write(name, row0,
    array)`` for chunks in any order, then ``w.close()`` (which checks every byte was written).
    """

    def __init__(
        self,
        path: Path,
        tensors: list[tuple[str, tuple[int, ...], str]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "mlx"})}
        slots: dict[str, _Slot] = {}
        offset = 0
        for name, shape, tag in tensors:
            nbytes = prod(shape) * _DTYPES[tag][2]
            header[name] = {
                "dtype": tag,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            rows = prod(shape[:-1]) if len(shape) > 1 else 1
            slots[name] = _Slot(offset, nbytes, nbytes // rows if rows else 0)
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes, as the spec advises
        self._base = 8 + len(blob)
        self._slots = slots
        self.total_bytes = self._base + offset
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(self._fd, struct.pack("<Q", len(blob)) + blob)
            os.ftruncate(self._fd, self.total_bytes)
        except OSError as exc:
            raise OutputError(
                f"cannot write {path} ({exc.strerror or exc}): check free space and permissions"
            ) from exc

    def row_bytes(self, name: str) -> int:
        """Bytes of one row of tensor ``name`` (its whole size for a 1-D tensor)."""
        return self._slots[name].row_bytes

    def region(self, name: str, row: int, nbytes: int) -> int:
        """File offset where ``nbytes`` bytes starting at row ``row`` of tensor ``name`` go."""
        slot = self._slots[name]
        offset = self._base + slot.start + row * slot.row_bytes
        if offset + nbytes > self._base + slot.start + slot.nbytes:
            raise ValueError(f"write past the end of {name} in {self.path}")
        return offset

    def mark_written(self, name: str, nbytes: int) -> None:
        """Count bytes of ``name`` written by someone else (a worker process) at ``region``."""
        self._slots[name].written += nbytes

    def write(self, name: str, row: int, data: memoryview) -> None:
        """Write ``data`` (bytes of whole rows) at row ``row`` of tensor ``name``.

        Pure file I/O (no MLX calls), so it may run on a writer thread.
        """
        offset = self.region(name, row, data.nbytes)
        try:
            pwrite_all(self._fd, data, offset)
        except OSError as exc:
            raise OutputError(
                f"cannot write {self.path} ({exc.strerror or exc}): check free space and permissions"
            ) from exc
        self.mark_written(name, data.nbytes)

    def abort(self) -> None:
        """Close the file without checking it (the caller discards the whole output)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def close(self) -> None:
        """Close the file; raise if any tensor was not completely written (a bug, not user input)."""
        os.close(self._fd)
        short = [n for n, s in self._slots.items() if s.written != s.nbytes]
        if short:
            raise RuntimeError(f"{self.path}: tensors not completely written: {short[:3]}")


def as_bytes(array: Any) -> memoryview:
    """The bytes of an MLX array in row-major order, as a flat memoryview (evaluates it)."""
    import mlx.core as mx

    if array.dtype == mx.bfloat16:  # Python's buffer protocol has no bfloat16: carry it as uint16
        array = array.view(mx.uint16)
    view = memoryview(array)
    if not view.c_contiguous:
        view = memoryview(mx.contiguous(array))
    return view.cast("B")
