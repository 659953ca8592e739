"""The ``hf2q`` command line: one thin module per command, wired together in :mod:`hf2q.cli.app`.

Command modules import only typer at module level; the library (and with it MLX) is imported
inside each command so that ``hf2q --help`` does not pay for it.
"""
