"""Resolve a model source (a local checkpoint folder or a Hugging Face Hub repo id) to a folder.

Hub repos are fetched with ``huggingface_hub.snapshot_download`` into its normal cache, so
``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` behave as users expect. Only the
files a model needs are fetched (config, safetensors, tokenizer files, chat template, generation
config). This module does not parse checkpoints.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf2q.errors import SourceError

#: Files a text model or drafter needs; everything else in a repo (images, ONNX, GGUF...) is skipped.
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo_id(source: str) -> bool:
    """True for ``owner/name`` strings that are not an existing local path."""
    return bool(_REPO_ID.match(source)) and not Path(source).expanduser().exists()


def resolve_source(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | None = None,
    allow_patterns: Sequence[str] = MODEL_FILE_PATTERNS,
    progress: bool = True,
    tqdm_class: Any = None,
) -> Path:
    """Return a local folder holding ``source``'s files, downloading them if needed.

    Args:
        source: a local folder, or a Hub repo id such as ``Qwen/Qwen3.5-4B``.
        revision: branch, tag or commit of a Hub repo (ignored for local folders).
        token: Hub token; defaults to the one huggingface_hub finds (``HF_TOKEN``, login).
        allow_patterns: which files of the repo to fetch.
        progress: show progress bars while downloading.
        tqdm_class: the progress bar class (a ``tqdm`` subclass, e.g. one drawing with Rich);
            None uses huggingface_hub's own bars.

    Raises:
        SourceError: the folder does not exist, or the repo cannot be fetched (offline and not
            cached, unknown repo, gated repo without a token, unknown revision).
    """
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise SourceError(
            f"{text} is a file, not a checkpoint folder: pass the folder that holds config.json"
        )
    if not looks_like_repo_id(text):
        raise SourceError(
            f"{text} is neither an existing folder nor a Hugging Face repo id like 'Qwen/Qwen3.5-4B': "
            "check the path"
        )
    return _snapshot(
        text,
        revision=revision,
        token=token,
        allow_patterns=allow_patterns,
        progress=progress,
        tqdm_class=tqdm_class,
    )


def _snapshot(
    repo_id: str,
    *,
    revision: str | None,
    token: str | None,
    allow_patterns: Sequence[str],
    progress: bool,
    tqdm_class: Any = None,
) -> Path:
    import huggingface_hub.errors as hf_errors
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=list(allow_patterns),
            **({"tqdm_class": tqdm_class} if tqdm_class is not None and progress else {}),
        )
    except GatedRepoError as exc:
        raise SourceError(
            f"{repo_id} is gated: accept its licence on huggingface.co and log in with "
            "'hf auth login' or set HF_TOKEN"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise SourceError(
            f"{repo_id} was not found on the Hugging Face Hub: check the repo id, or log in "
            "('hf auth login') if it is private"
        ) from exc
    except RevisionNotFoundError as exc:
        raise SourceError(f"{repo_id} has no revision {revision!r}: check --revision") from exc
    except getattr(hf_errors, "IncompleteSnapshotError", _Never) as exc:
        # huggingface_hub >= 1.x: the cached snapshot lacks files and the Hub cannot be reached.
        raise SourceError(
            f"the cached copy of {repo_id} is incomplete and the Hub cannot be reached: run "
            f"'hf download {repo_id}' with network access, or pass a complete local folder"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise SourceError(_offline_message(repo_id, revision)) from exc
    except OSError as exc:
        # Network failures surface as requests/httpx errors, both OSError subclasses here.
        raise SourceError(
            f"could not download {repo_id} ({type(exc).__name__}): check the network, or set "
            "HF_HUB_OFFLINE=1 to use the local cache"
        ) from exc
    finally:
        if not progress:
            enable_progress_bars()
    return Path(folder)


class _Never(Exception):
    """Stands in for exception classes an older huggingface_hub does not define."""


def _offline_message(repo_id: str, revision: str | None) -> str:
    rev = f" at revision {revision}" if revision else ""
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return (
            f"{repo_id}{rev} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: download it "
            f"once with network access ('hf download {repo_id}'), or pass a local folder"
        )
    return (
        f"{repo_id}{rev} could not be downloaded and is not in the Hugging Face cache: check the "
        "network connection, or pass a local folder"
    )
