"""Errors a user can act on.

Every failure the user can fix is raised as :class:`Hf2qError` (or a subclass) whose message is
one line that names the fix. The CLI prints it as ``hf2q: error: <message>`` and exits non-zero;
``HF2Q_DEBUG=1`` adds the traceback. Anything else that escapes is a bug and is reported as one.
"""

from __future__ import annotations


class Hf2qError(Exception):
    """A failure caused by input or environment, with a one-line message naming the fix."""

    exit_code: int = 2

    def __init__(self, message: str) -> None:
        # Keep the message on one line: the CLI promises one line per error.
        super().__init__(" ".join(str(message).split()))


class UsageError(Hf2qError):
    """A bad option value or combination of options."""


class ModelError(Hf2qError):
    """A checkpoint that is missing, malformed or of an unsupported architecture."""


class DrafterError(ModelError):
    """A drafter that cannot be used (unknown format, or it does not fit the target)."""


class SourceError(Hf2qError):
    """A model source (local folder or Hub repo id) that cannot be resolved."""


class OutputError(Hf2qError):
    """An output path that cannot be written."""


class DataError(Hf2qError):
    """Training or evaluation data that is missing, empty or malformed."""
