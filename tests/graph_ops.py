"""The primitives of a lazy MLX graph, for tests that check what a path builds (each node is one
the host encodes on a GPU)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import mlx.core as mx

_NODE = re.compile(r'label ="([^"]+)", shape=rectangle')


def ops(*arrays: mx.array) -> list[str]:
    """The primitive of every node the evaluation of ``arrays`` would run (``mx.export_to_dot``)."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return _NODE.findall(Path(f.name).read_text())
