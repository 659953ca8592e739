"""The output folder: written whole into a hidden sibling, then renamed into place.

What it does: check the output path before any work (exists without ``--force``, would replace
the source, not writable, not enough free space), create the temporary sibling
``.<OUT>.hf2q-partial-<pid>`` next to OUT, remove stale ones left by killed runs, write
``config.json``, ``model.safetensors.index.json``, the tokenizer / chat template / generation
config files, and finally rename the sibling to OUT (replacing an old OUT only with ``--force``).
A failed or interrupted conversion removes its sibling; a killed one leaves only the hidden
sibling, never a half-written OUT.

What it does not do: produce tensor data (``hf2q.convert.quantize``).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf2q.errors import OutputError
from hf2q.hub import MODEL_FILE_PATTERNS

PARTIAL_TAG = ".hf2q-partial-"
_OLD_TAG = ".hf2q-old-"

#: Files copied verbatim from the source (everything hf2q fetches except config and weights).
COPIED_PATTERNS = tuple(
    p
    for p in MODEL_FILE_PATTERNS
    if p not in ("config.json", "*.safetensors", "*.safetensors.index.json")
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_partials(out: Path) -> list[Path]:
    """Hidden siblings of ``out`` left by conversions whose process no longer exists."""
    stale = []
    if not out.parent.is_dir():
        return stale
    for tag in (PARTIAL_TAG, _OLD_TAG):
        for p in out.parent.glob(f".{out.name}{tag}*"):
            suffix = p.name.rsplit("-", 1)[-1]
            if suffix.isdigit() and not _pid_alive(int(suffix)):
                stale.append(p)
    return stale


def check_output(out: Path, source: Path, *, force: bool) -> None:
    """Refuse an output path that cannot or must not be written, before any work is done."""
    out = out.expanduser()
    src = source.resolve()
    dst = out.resolve()
    if dst == src or dst in src.parents:
        raise OutputError(
            f"the output {out} would replace the source checkpoint {source}: choose another -o folder"
        )
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise OutputError(f"{out} exists and is not a folder: remove it or choose another -o")
        if not force:
            raise OutputError(
                f"{out} already exists: pass --force to replace it, or choose another -o"
            )
    parent = _existing_ancestor(dst.parent)
    if not parent.is_dir():
        raise OutputError(f"cannot write under {parent}: it is not a folder, choose another -o")
    # Probe by creating a folder: permission bits alone say nothing for root or read-only mounts.
    try:
        probe = Path(tempfile.mkdtemp(prefix=".hf2q-probe-", dir=parent))
    except OSError as exc:
        raise OutputError(
            f"cannot write to {parent} ({exc.strerror or exc}): choose a writable -o folder"
        ) from exc
    probe.rmdir()


def check_space(out: Path, need_bytes: int) -> None:
    """Refuse when the output's file system lacks room for ``need_bytes`` (plus a small margin)."""
    parent = _existing_ancestor(out.expanduser().resolve().parent)
    free = shutil.disk_usage(parent).free
    need = int(need_bytes * 1.01) + (16 << 20)
    if free < need:
        raise OutputError(
            f"{parent} has {free / 2**30:.2f} GB free but the output needs about "
            f"{need / 2**30:.2f} GB: free some space or choose another -o"
        )


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def staging(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a fresh hidden sibling of ``out`` to write into; on success rename it to ``out``.

    On any exception (KeyboardInterrupt included) the sibling and any parent folders created for
    it are removed and the exception propagates; ``out`` is untouched.
    """
    out = out.expanduser().absolute()
    created: list[Path] = []
    temp = out.parent / f".{out.name}{PARTIAL_TAG}{os.getpid()}"
    # Everything from the first folder made to the rename is inside one guard: an interrupt that
    # lands right after a mkdir (a SIGTERM sent as soon as the sibling appears, on a loaded
    # machine) must still remove what was made.
    try:
        parent = out.parent
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except OSError as exc:
                raise OutputError(
                    f"cannot create {out.parent} ({exc.strerror or exc}): choose a writable -o folder"
                ) from exc
            created.append(d)
        for old in stale_partials(out):
            shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
        try:
            temp.mkdir()
        except OSError as exc:
            raise OutputError(
                f"cannot write to {out.parent} ({exc.strerror or exc}): choose a writable -o folder"
            ) from exc
        yield temp
        _move_into_place(temp, out, force=force)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        _remove_created(created)
        raise


def _remove_created(created: list[Path]) -> None:
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


def _move_into_place(temp: Path, out: Path, *, force: bool) -> None:
    old = None
    if out.exists() or out.is_symlink():
        if not force:
            raise OutputError(f"{out} appeared while converting: pass --force to replace it")
        old = out.parent / f".{out.name}{_OLD_TAG}{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    try:
        os.rename(temp, out)
    except OSError as exc:
        if old is not None:
            os.rename(old, out)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise OutputError(
                f"{out} appeared while converting: pass --force to replace it"
            ) from exc
        raise OutputError(
            f"cannot create {out} ({exc.strerror or exc}): choose another -o"
        ) from exc
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_side_files(source: Path, dest: Path) -> list[str]:
    """Copy tokenizer files, chat template and generation config verbatim; return their names."""
    copied = []
    for entry in sorted(source.iterdir()):
        if entry.is_file() and any(fnmatch.fnmatch(entry.name, p) for p in COPIED_PATTERNS):
            shutil.copyfile(entry, dest / entry.name)  # follows the Hub cache's symlinks
            copied.append(entry.name)
    return copied


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_index(dest: Path, files: dict[str, list[str]], *, total_size: int, params: int) -> None:
    """``model.safetensors.index.json`` as mlx-lm and transformers write it."""
    weight_map = {
        name: fname for fname, names in files.items() if fname.startswith("model") for name in names
    }
    write_json(
        dest / "model.safetensors.index.json",
        {
            "metadata": {"total_size": total_size, "total_parameters": params},
            "weight_map": dict(sorted(weight_map.items())),
        },
    )
