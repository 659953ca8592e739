"""Typer options shared by several commands (one wording, one default, everywhere)."""

from __future__ import annotations

from typing import Annotated

import typer

#: ``--model/-m``: the target; omitted means the embedded demo pair.
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Target: a model folder (raw Hugging Face or converted) or Hub repo id. "
        "Omitted: the embedded demo pair.",
    ),
]

#: ``--draft/-d``: the DFlash drafter; omitted means the registry entry for the target.
DraftOption = Annotated[
    str | None,
    typer.Option(
        "--draft",
        "-d",
        help="DFlash drafter folder or Hub repo id (default: the registry entry for --model).",
    ),
]

#: ``--dtype``: the dtype the models compute in (None means auto).
DtypeOption = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Compute dtype: auto (float32 for half-precision weights on a CPU, else as loaded), "
        "native (as loaded), float32, bfloat16 or float16.",
    ),
]
