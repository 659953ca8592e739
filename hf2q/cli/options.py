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

#: ``--draft-head-bits``: drafts read a 4- or 8-bit copy of the target's head (0: the head itself).
DraftHeadBitsOption = Annotated[
    int,
    typer.Option(
        "--draft-head-bits",
        envvar="HF2Q_DRAFT_HEAD_BITS",
        help="Drafts read a 4- or 8-bit copy of the target's head (its largest product; a "
        "drafter shares it): the same output (the verify keeps the full head), shorter rounds "
        "where the head weighs on the draft (one slot of a 4B model on an H100: 6.41 -> 6.21 "
        "ms with 4 bits; drafts of three or more slots keep the full head, faster there); may "
        "accept fewer tokens a round. 0: the head itself.",
    ),
]


#: ``--draft-vocab``: drafts propose from the K lowest token ids (and the special ones) only.
DraftVocabOption = Annotated[
    int,
    typer.Option(
        "--draft-vocab",
        envvar="HF2Q_DRAFT_VOCAB",
        help="Drafts propose only from the K lowest token ids plus the special ones (a "
        "frequency-ranked draft vocabulary, as FR-Spec; BPE ids run from the most frequent "
        "pieces): the drafts read K of the head's rows instead of all (Qwen3.5: 248320), the "
        "output is the same (the verify keeps the full head); may accept fewer tokens a round. "
        "Combines with --draft-head-bits. 0: the whole vocabulary.",
    ),
]


def check_draft_vocab(vocab: int) -> int:
    """``--draft-vocab`` checked before anything loads (0, or a positive token count)."""
    from hf2q.errors import UsageError

    if vocab < 0:
        raise UsageError(
            f"--draft-vocab must be 0 (the whole vocabulary) or a token count, got {vocab}"
        )
    return vocab


def parse_block_size(value: str | None) -> int | str | None:
    """``--block-size`` checked before anything loads: None (the default), ``"auto"``, or a
    whole number of at least 2 (the drafter's limit is checked once it is loaded)."""
    from hf2q.errors import UsageError
    from hf2q.runtime.block_size import AUTO

    if value is None:
        return None
    word = value.strip().lower()
    if word == AUTO:
        return AUTO
    try:
        size = int(word)
    except ValueError:
        size = None
    if size is None or size < 2:
        raise UsageError(
            f"--block-size must be auto or a whole number from 2 (one token plus one draft) to "
            f"the drafter's block size, got {value!r}"
        )
    return size


def check_draft_head_bits(bits: int) -> int:
    """``--draft-head-bits`` checked before anything loads (0, 4 or 8)."""
    from hf2q.errors import UsageError

    if bits not in (0, 4, 8):
        raise UsageError(f"--draft-head-bits must be 0, 4 or 8, got {bits}")
    return bits
