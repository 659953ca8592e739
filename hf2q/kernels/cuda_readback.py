"""A lagged round's outcome as 8-byte words the host reads without a copy (``mx.fast.cuda_kernel``).

Why: on MLX's CUDA backend an array the host reads (``tolist``, ``item``) must live in managed
memory. Arrays of up to 8 bytes are allocated there; a larger one is moved on its first read by a
synchronous ``cudaMemcpy`` (``Buffer::raw_ptr`` in ``mlx/backend/cuda/allocator.cpp``), and that
copy waits until the device has finished the graph it is running. A lagged round reads the round
before while the next one is queued, so the read of the drafts (15 tokens: 60 bytes) waited for
the queued verify: in the one-slot kernel trace of the 4B-shaped pair on an H100 (session 47,
``benchmarks/results/h100/session47``) one ``cudaMemcpy`` a round held the host 1.38 ms (up to
1.8), after which the device idled 0.73 ms waiting for the host's next graph. With more slots the
accepted counts, the bonus tokens and the cache offsets (4 bytes a row) are copied the same way.

What it does: :func:`pack_round` turns a round's drafts, accepted counts, bonus tokens, lookup
choices and cache offsets into R x W separate int64 arrays of shape (1,), one launch for all of
them; each is 8 bytes, so MLX allocates it in managed memory and the host reads it in place.
Row r's word 0 holds its accepted count ``a`` (bits 0-4), whether lookup drafted it (bit 5) and
its offsets in the target's and the drafter's attention caches (28 bits each); words 1.. hold its committed tokens (the first ``a`` drafts, then the
bonus token), ``63 // bits`` of ``bits`` bits each, lowest first. :func:`read_round` reads word 0
of every row, then only the words a busy row's ``a + 1`` tokens fill (two of seven for five
tokens at Qwen3.5's 18-bit vocabulary and block size 16).

:func:`token_words` does the same for a plain batched step's tokens (from 3 rows they are more
than 8 bytes, and the step queued behind them is what their copy would wait for).
:func:`host_ints` is the other direction: a small integer array a round makes from host values
(last tokens, kept counts, offsets) joined on the device from arrays of at most 8 bytes, because
a new host array of more than 8 bytes may be given a freed device buffer that MLX first moves to
managed memory with the same kind of synchronous copy (``CudaAllocator::malloc_async``).

What it does not do: decide acceptance, or run anywhere but an NVIDIA GPU (elsewhere the host
reads the arrays themselves: CPUs and Apple GPUs share memory, nothing is copied).
:func:`pack_round_ops` is the ops reference the tests check the kernel against.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, NamedTuple

import mlx.core as mx

from hf2q.kernels import select
from hf2q.kernels.cuda_rollback import compiled_on_cuda

#: Bits of word 0 below the offsets: the accepted count (5 bits, so blocks of up to 32) and the
#: lookup bit; then two offsets of :data:`OFFSET_BITS` bits each.
COUNT_BITS = 5
OFFSET_SHIFT = COUNT_BITS + 1
OFFSET_BITS = 28
#: The largest offset word 0 holds.
MAX_OFFSET = (1 << OFFSET_BITS) - 1
#: The largest block :func:`pack_round` packs (its accepted count must fit :data:`COUNT_BITS`).
MAX_BLOCK = 1 << COUNT_BITS


class Layout(NamedTuple):
    """How one row's committed tokens are packed: ``bits`` per token, ``per`` tokens a word,
    ``words`` words a row (word 0 included) for blocks of ``block`` tokens."""

    bits: int
    per: int
    words: int
    block: int


def layout(vocab: int, block: int) -> Layout:
    """The packing of blocks of ``block`` tokens from a vocabulary of ``vocab`` ids."""
    bits = max(1, (vocab - 1).bit_length())
    per = 63 // bits
    return Layout(bits, per, 1 + -(-block // per), block)


def _source(rows: int, words: int) -> str:
    writes = "\n".join(
        f"    case {r}: "
        + " ".join(f"w{r}_{k}[0] = (int64_t)w[{k}];" for k in range(words))
        + " break;"
        for r in range(rows)
    )
    return f"""
  const int r = threadIdx.x;
  if (r >= R) return;
  const int a = acc[r];
  unsigned long long w[W];
  w[0] = (unsigned long long)(a & ((1 << {COUNT_BITS}) - 1))
      | ((unsigned long long)(use[r] ? 1 : 0) << {COUNT_BITS})
      | ((unsigned long long)((unsigned)off0[r] & {MAX_OFFSET}u) << {OFFSET_SHIFT})
      | ((unsigned long long)((unsigned)off1[r] & {MAX_OFFSET}u) << {OFFSET_SHIFT + OFFSET_BITS});
  for (int k = 1; k < W; ++k) w[k] = 0ull;
  for (int i = 0; i <= a && i <= D; ++i) {{
    const unsigned long long t =
        (unsigned long long)(unsigned)(i < a ? draft[r * D + i] : bonus[r]) & MASK;
    w[1 + i / PER] |= t << ((i % PER) * BITS);
  }}
  switch (r) {{
{writes}
    default: break;
  }}
"""


def spec(rows: int, words: int) -> tuple[str, list[str], list[str], str]:
    """(name, input names, output names, source) of the kernel for ``rows`` rows of ``words``
    words (the CPU tests build the same in their emulator)."""
    outs = [f"w{r}_{k}" for r in range(rows) for k in range(words)]
    name = f"hf2q_round_words_{rows}_{words}"
    return name, ["draft", "acc", "bonus", "use", "off0", "off1"], outs, _source(rows, words)


@cache
def _kernel(rows: int, words: int) -> Any:
    name, ins, outs, source = spec(rows, words)
    return mx.fast.cuda_kernel(name=name, input_names=ins, output_names=outs, source=source)


@cache
def _zeros(rows: int, dtype: Any) -> mx.array:
    z = mx.zeros((rows,), dtype=dtype)
    mx.eval(z)
    return z


class RoundArrays(NamedTuple):
    """What :func:`pack_round` packs, on the device.

    Attributes:
        draft: (R, B-1) int32 drafted tokens.
        acc: (R,) accepted drafts per row.
        bonus: (R,) the token each row's verify chose after its accepted drafts.
        use: (R,) bool, whether lookup drafted the row (None: no lookup).
        offsets: up to two (R,) int32 offset arrays (the target's and the drafter's attention
            caches after the round), each at most :data:`MAX_OFFSET`.
    """

    draft: mx.array
    acc: mx.array
    bonus: mx.array
    use: mx.array | None = None
    offsets: Sequence[mx.array] = ()


def _inputs(rnd: RoundArrays) -> list[mx.array]:
    """The kernel's inputs in its dtypes (absent lookup choices and offsets: zeros)."""
    R = rnd.draft.shape[0]
    use = _zeros(R, mx.bool_) if rnd.use is None else rnd.use.astype(mx.bool_)
    offs = [o.astype(mx.int32) for o in rnd.offsets]
    offs += [_zeros(R, mx.int32)] * (2 - len(offs))
    draft, acc, bonus = (x.astype(mx.int32) for x in (rnd.draft, rnd.acc, rnd.bonus))
    return [draft, acc, bonus, use, *offs]


def _launch(inputs: list[mx.array], lay: Layout) -> list[mx.array]:
    R, D = inputs[0].shape
    return _kernel(R, lay.words)(
        inputs=inputs,
        template=[
            ("R", R),
            ("D", D),
            ("W", lay.words),
            ("PER", lay.per),
            ("BITS", lay.bits),
            ("MASK", (1 << lay.bits) - 1),
        ],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)] * (R * lay.words),
        output_dtypes=[mx.int64] * (R * lay.words),
    )


@cache
def _launcher(lay: Layout) -> Any:
    """The launch for one layout, compiled on CUDA (MLX would build the kernel's source and
    signature again on every call of the Python function); uncompiled in the CPU tests' emulator."""
    return compiled_on_cuda(lambda *inputs: _launch(list(inputs), lay))


def supported(draft: mx.array, lay: Layout, offsets: int = 0, bound: int = 0) -> str | None:
    """Why :func:`pack_round` cannot pack these drafts with ``offsets`` distinct offset arrays
    whose values are at most ``bound`` (None when it can)."""
    if draft.ndim != 2:
        return f"drafts of shape {draft.shape} (needs (rows, block - 1))"
    R, D = draft.shape
    if D + 1 > MAX_BLOCK:
        return f"a block of {D + 1} tokens (at most {MAX_BLOCK})"
    if R > 32:
        return f"{R} rows (at most 32)"
    if lay.bits > 31:
        return f"token ids of {lay.bits} bits"
    if offsets > 2:
        return f"{offsets} distinct cache offsets (at most 2)"
    if bound > MAX_OFFSET:
        return f"cache offsets up to {bound} (at most {MAX_OFFSET})"
    return None


def pack_round(rnd: RoundArrays, lay: Layout) -> list[list[mx.array]]:
    """Row by row the words of a round (see the module docstring), one launch; ``lay``:
    :func:`layout` of the target's vocabulary and this block."""
    R = rnd.draft.shape[0]
    w = _launcher(lay)(*_inputs(rnd))
    return [w[r * lay.words : (r + 1) * lay.words] for r in range(R)]


def pack_round_ops(rnd: RoundArrays, lay: Layout) -> mx.array:
    """The ops reference of :func:`pack_round`: the words as one (R, W) int64 array."""
    d, a, b, u, o0, o1 = _inputs(rnd)
    R, D = d.shape
    i = mx.arange(D + 1)[None]
    ext = mx.concatenate([d, mx.zeros((R, 1), dtype=mx.int32)], axis=1)
    tok = mx.where(i < a[:, None], ext, mx.where(i == a[:, None], b[:, None], 0))
    tok = tok.astype(mx.int64) & ((1 << lay.bits) - 1)
    slots = (lay.words - 1) * lay.per
    tok = mx.concatenate([tok, mx.zeros((R, slots - (D + 1)), dtype=mx.int64)], axis=1)
    shifts = (mx.arange(lay.per) * lay.bits).astype(mx.int64)
    words = (tok.reshape(R, lay.words - 1, lay.per) << shifts).sum(axis=-1)
    w0 = (a.astype(mx.int64) & (MAX_BLOCK - 1)) | (u.astype(mx.int64) << COUNT_BITS)
    w0 = w0 | ((o0.astype(mx.int64) & MAX_OFFSET) << OFFSET_SHIFT)
    w0 = w0 | ((o1.astype(mx.int64) & MAX_OFFSET) << (OFFSET_SHIFT + OFFSET_BITS))
    return mx.concatenate([w0[:, None], words], axis=1)


#: The most values :func:`host_ints` joins from pieces (more: one array).
MAX_PIECE_VALUES = 32


def host_ints(values: Sequence[int]) -> mx.array:
    """``values`` as an (n,) int32 array; where ``HF2Q_HOST_PIECES`` is on (CUDA) and it would
    take more than 8 bytes, joined on the device from arrays of at most 8 bytes.

    Why: a new host array of more than 8 bytes may be given a freed device buffer, which MLX's
    CUDA backend first moves to managed memory with a synchronous copy that waits for the graph
    the device is running (``CudaAllocator::malloc_async``); arrays of up to 8 bytes are allocated
    in managed memory. The pieces cost one concatenate kernel.
    """
    vals = [int(v) for v in values]
    if len(vals) <= 2 or len(vals) > MAX_PIECE_VALUES or not select.host_pieces_enabled():
        return mx.array(vals, dtype=mx.int32)
    return mx.concatenate(
        [mx.array(vals[i : i + 2], dtype=mx.int32) for i in range(0, len(vals), 2)]
    )


class RowOutcome(NamedTuple):
    """What :func:`read_round` read of one row: accepted drafts, committed tokens (the accepted
    drafts, then the bonus; empty for a row not read), whether lookup drafted it, its two
    offsets."""

    accepted: int
    committed: list[int]
    looked_up: bool
    offsets: tuple[int, int]


def read_round(
    words: Sequence[Sequence[mx.array]], busy: Sequence[bool], lay: Layout
) -> list[RowOutcome]:
    """Read a round's words on the host: word 0 of every row, then the token words of the busy
    rows, as many as their ``a + 1`` committed tokens fill."""
    mask = (1 << lay.bits) - 1
    out = []
    for row, b in zip(words, busy, strict=True):
        w0 = int(row[0].item())
        a = w0 & (MAX_BLOCK - 1)
        tokens: list[int] = []
        if b:
            n = a + 1
            for k in range(-(-n // lay.per)):
                w = int(row[1 + k].item())
                take = min(lay.per, n - k * lay.per)
                tokens += [(w >> (j * lay.bits)) & mask for j in range(take)]
        offs = (w0 >> OFFSET_SHIFT) & MAX_OFFSET, (w0 >> (OFFSET_SHIFT + OFFSET_BITS)) & MAX_OFFSET
        out.append(RowOutcome(a, tokens, bool((w0 >> COUNT_BITS) & 1), offs))
    return out


class Words(NamedTuple):
    """A round's words, row by row (:func:`pack_round`), with their layout."""

    rows: list[list[mx.array]]
    lay: Layout

    def read(self, busy: Sequence[bool]) -> list[RowOutcome]:
        """:func:`read_round` of these words."""
        return read_round(self.rows, busy, self.lay)

    def tokens(self) -> list[int]:
        """Each row's token, of :func:`token_words`' words: one read a row."""
        mask = (1 << self.lay.bits) - 1
        return [int(row[1].item()) & mask for row in self.rows]


def words_of(rnd: RoundArrays, vocab: int, bound: int = 0) -> Words | None:
    """:func:`pack_round` of ``rnd`` (tokens below ``vocab``, offsets at most ``bound``) with its
    layout, or None where the words cannot hold it (the arrays are read instead)."""
    lay = layout(vocab, rnd.draft.shape[1] + 1)
    if supported(rnd.draft, lay, len(rnd.offsets), bound) is not None:
        return None
    return Words(pack_round(rnd, lay), lay)


def token_words(tokens: mx.array, vocab: int) -> Words | None:
    """A plain decoding step's tokens (R,) as words (:meth:`Words.tokens` reads them): the
    words of a one-token block none of whose drafts is accepted, so a row's word 1 holds its
    token."""
    R = tokens.shape[0]
    return words_of(RoundArrays(tokens[:, None], _zeros(R, mx.int32), tokens), vocab)
