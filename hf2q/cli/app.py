"""Wiring of the ``hf2q`` Typer app and the one place where exceptions become exit codes.

Commands live one per module in this package; this module only registers them. ``main`` maps
:class:`hf2q.errors.Hf2qError` and Click usage errors to a single line on stderr and a non-zero
exit, and turns anything unexpected into a one-line report (``HF2Q_DEBUG=1`` shows tracebacks).
"""

from __future__ import annotations

import os
import sys

import typer

from hf2q import __version__
from hf2q.errors import Hf2qError

app = typer.Typer(
    name="hf2q",
    help="Fetch and quantize Hugging Face checkpoints for MLX; run lossless DFlash speculative "
    "decoding on Qwen3.5 / Qwen3.6; measure it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"hf2q {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """hf2q: make large language models fast on one machine with MLX."""


def _register() -> None:
    # Each command module exposes ``register(app)``; importing them must stay cheap (no MLX).
    from hf2q.cli import bench, convert, generate, info, train_draft

    for module in (info, convert, generate, bench, train_draft):
        module.register(app)


_register()


def _debug() -> bool:
    return os.environ.get("HF2Q_DEBUG", "") not in ("", "0")


def _fail(message: str, code: int) -> int:
    print(f"hf2q: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def _is_click(exc: BaseException, name: str) -> bool:
    # Typer >= 0.26 vendors Click (typer._click), older releases use click itself: match both.
    return any(
        cls.__name__ == name and cls.__module__.split(".")[0] in ("click", "typer")
        for cls in type(exc).__mro__
    )


#: True when ``main`` runs as the process's entry point (console script / ``python -m hf2q``),
#: False when called with an argv from Python (tests): only then may a command re-execute.
STANDALONE = False


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the process exit code (also used by ``python -m hf2q``)."""
    global STANDALONE
    STANDALONE = argv is None
    from hf2q.platform import keep_float32_exact

    keep_float32_exact()
    try:
        code = app(args=argv, prog_name="hf2q", standalone_mode=False)
    except Hf2qError as exc:
        if _debug():
            raise
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        if _debug():
            raise
        return _fail("interrupted", 130)
    except BrokenPipeError:
        return 0
    except Exception as exc:
        if _is_click(exc, "Exit"):
            return int(getattr(exc, "exit_code", 0) or 0)
        if _is_click(exc, "Abort"):
            return _fail("interrupted", 130)
        if _debug():
            raise
        if _is_click(exc, "ClickException"):
            ctx = getattr(exc, "ctx", None)
            where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            return _fail(exc.format_message() + where, int(getattr(exc, "exit_code", 2) or 2))
        # Anything else is a bug: say so in one line, traceback on request.
        return _fail(
            f"internal error: {type(exc).__name__}: {exc} "
            "(set HF2Q_DEBUG=1 for the traceback and report it)",
            1,
        )
    # Typer turns Ctrl-C inside a command into Exit(130) and, outside standalone mode, returns it.
    if code == 130:
        return _fail("interrupted", 130)
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


if __name__ == "__main__":
    raise SystemExit(main())
