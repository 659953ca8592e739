"""Where hf2q's data files (``configs/``: quantization recipes, drafter registry) live.

An installed wheel carries them as ``hf2q/configs`` (pyproject's force-include); an editable
install or a source checkout has them at the repository root. This module only finds files; it
does not parse them.
"""

from __future__ import annotations

from pathlib import Path

import hf2q


def config_dirs() -> list[Path]:
    """Folders that may hold hf2q's configs, in lookup order (packaged first, then the repo's)."""
    package = Path(hf2q.__file__).resolve().parent
    return [package / "configs", package.parent / "configs"]


def config_file(*parts: str) -> Path | None:
    """The first ``configs/<parts...>`` that exists, or None."""
    for folder in config_dirs():
        candidate = folder.joinpath(*parts)
        if candidate.exists():
            return candidate
    return None


def config_listing(subdir: str, pattern: str = "*") -> list[Path]:
    """Files matching ``pattern`` in ``configs/<subdir>`` (packaged copies shadow the repo's)."""
    seen: dict[str, Path] = {}
    for folder in config_dirs():
        for path in sorted((folder / subdir).glob(pattern)):
            seen.setdefault(path.name, path)
    return [seen[name] for name in sorted(seen)]
