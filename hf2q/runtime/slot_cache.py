"""Caches for N sequences decoded together ("slots"), each row with its own length and rollback.

What it does: :class:`SlotKVCache` is an attention KV cache in mlx-lm's cache protocol
(``offset``, ``update_and_fetch``, ``make_mask``, ``trim``, ``state``) whose rows hold different
numbers of positions: ``offset`` is an ``mx.array`` (N,), row i's keys live at buffer positions
``[0, offset[i])`` of a fixed-capacity (N, H, C, D) buffer, new keys are written at each row's
own position, and ``make_mask(L)`` returns the per-row boolean mask (N, 1, L, K) (causal inside
the new positions, nothing beyond a row's own end). mlx-lm's own attention modules run on it
unchanged: they apply RoPE with ``offset=cache.offset`` (``mx.fast.rope`` takes one offset per
batch row) and call ``update_and_fetch``. Rolling a row back only moves its offset; the stale
tail is masked and overwritten by the row's next write, so nothing is copied. The layers of one
model hold the same positions, so their offsets are one shared array and the position arithmetic
of a write, an advance or a rollback is built once for all of them (:class:`_Shared`): fewer
graph nodes for the host to encode a round (arrays are never assigned into, so sharing is safe).

:class:`SlotTargetCache` is a :class:`~hf2q.runtime.cache.TargetCache` whose attention layers are
``SlotKVCache`` and whose Gated-DeltaNet layers are ``GDNRollbackCache`` with N rows; its
:meth:`~SlotTargetCache.rollback` takes one kept count per row (ragged), and
:meth:`~SlotTargetCache.insert` copies a request prefilled alone into one row.

Why not mlx-lm's ``BatchKVCache``: it left-pads rows to one shared write index and trims all rows
by the same count. A ragged rollback there means shifting every rolled-back row right by its own
count (a copy of the whole buffer per layer per round) and growing the left padding, and the
buffer grows by the full block every round whatever was accepted. Per-row offsets need neither.

What it does not do: run layers, decide acceptance, or schedule requests (``hf2q.runtime.slots``).
Sliding-window (rotating) and quantized KV caches are not supported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, _BaseCache

from hf2q.kernels.cuda_readback import host_ints
from hf2q.kernels.select import bucketed, kv_row_scatter, sdpa_bucket
from hf2q.runtime.cache import GDNRollbackCache, TargetCache, key_mask, rollback_in_one_launch


class _Shared:
    """The position arithmetic the layers of one model would each repeat, made once.

    Every attention layer of a target (and every layer of a drafter) holds the same positions
    per row: the same offsets advance by the same counts, so each layer's write positions, new
    offsets and dropped counts are the same values. Built per layer they are separate graph
    nodes (about seven a layer and round for ragged rows), each one the host encodes on a GPU.
    This memo returns the array already built for the same inputs: inputs are arrays (matched
    by identity, held here so that an identity is never reused while its entry lives) and host
    values. The caches take their offsets from it, so the layers end up sharing one offset
    array and every later derivation too. Lazy arrays are immutable, so a shared one is the
    same value whichever layer asks; a bounded number of entries is kept.
    """

    SIZE = 64

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple[tuple, mx.array]] = {}

    def get(self, key: tuple, build: Callable[[], mx.array]) -> mx.array:
        ident = tuple(("a", id(k)) if isinstance(k, mx.array) else k for k in key)
        hit = self._memo.get(ident)
        if hit is not None and all(
            a is b for a, b in zip(hit[0], key, strict=True) if isinstance(b, mx.array)
        ):
            return hit[1]
        out = build()
        if len(self._memo) >= self.SIZE:
            self._memo.clear()
        self._memo[ident] = (key, out)
        return out


_SHARED = _Shared()


def _offsets(lengths: Sequence[int]) -> mx.array:
    """The offsets (rows,) int32 for host-known ``lengths``, one array for equal lists."""
    vals = tuple(int(v) for v in lengths)
    return _SHARED.get(("offsets", vals), lambda: host_ints(vals))


def _moved(offset: mx.array, sign: int, by: int | Sequence[int] | mx.array) -> mx.array:
    """``offset + sign * by`` (``by``: an int, one int per row, or a lazy (rows,) array),
    shared between the layers whose offsets are the same array."""
    if isinstance(by, mx.array):
        key: tuple = ("moved", offset, sign, by)
        step = by if by.dtype == mx.int32 else by.astype(mx.int32)
    elif isinstance(by, int):
        key, step = ("moved", offset, sign, by), by
    else:
        vals = tuple(int(v) for v in by)
        key = ("moved", offset, sign, vals)
        step = vals[0] if len(set(vals)) == 1 else host_ints(vals)
    return _SHARED.get(key, lambda: offset + step if sign > 0 else offset - step)


def _per_row(value: int | Sequence[int] | mx.array, rows: int, what: str) -> list[int]:
    """``value`` as one int per row (an int applies to every row)."""
    if isinstance(value, int):
        return [int(value)] * rows
    vals = value.tolist() if isinstance(value, mx.array) else [int(v) for v in value]
    if len(vals) != rows:
        raise ValueError(f"{what} needs one value per row ({rows}), got {len(vals)}")
    return [int(v) for v in vals]


def _check_prepared(lengths: list[int], L: int) -> list[int]:
    """``lengths`` (host counts a write of ``L`` positions advances the rows by), checked."""
    if any(not 0 <= a <= L for a in lengths):
        raise ValueError(f"prepared lengths must be in 0..{L}, got {lengths}")
    return lengths


class SlotKVCache(_BaseCache):
    """A KV cache of N rows with one offset per row (see the module docstring).

    Attributes:
        keys, values: (N, H, C, D) buffers of capacity C (None until the first write).
        offset: (N,) int32, positions held per row (what RoPE and the masks use).
        lengths: the same offsets as a host-side list (the buffer's used extent is their max).
    """

    step = 256
    #: Row b's key of position p sits at buffer index p, its offset is the next position (see
    #: ``hf2q.kernels.attention.reads_buffer_in_place``).
    positions_are_indices = True

    def __init__(self, rows: int, bucket: int | None = None) -> None:
        if rows < 1:
            raise ValueError(f"a slot cache needs at least one row, got {rows}")
        #: Pad the keys of multi-position writes to a multiple of this (masked; see
        #: ``hf2q.runtime.cache.BucketedKVCache``), or None.
        self.bucket = bucket
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths: list[int] = [0] * rows
        self.offset = _offsets([0] * rows)
        self._advance: list[int] | mx.array | None = None
        #: Lagged rounds (``hf2q.runtime.slots``, ``lagged=True``): ``offset`` moves by counts the
        #: host has not read yet (``prepare`` / ``rollback`` with arrays), so ``lengths`` only
        #: bound the rows from above (the buffer extent every write and mask covers) until
        #: :meth:`resync` makes them exact again.
        self.lagged = False
        #: Positions added to ``lengths`` by writes since the cache was made, per row (what
        #: :meth:`resync` adds back on top of the exact offsets of a :meth:`mark`).
        self._grown: list[int] = [0] * rows

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def size(self) -> int:
        return max(self.lengths)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def _reserve(self, need: int, like_k: mx.array, like_v: mx.array) -> None:
        """Make the buffer hold at least ``need`` positions (grown in steps of ``step``)."""
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        cap = -(-need // self.step) * self.step
        N, (_, H, _, Dk), Dv = self.rows, like_k.shape, like_v.shape[3]
        if self.keys is None:
            self.keys = mx.zeros((N, H, cap, Dk), dtype=like_k.dtype)
            self.values = mx.zeros((N, H, cap, Dv), dtype=like_v.dtype)
            return
        grow = cap - self.keys.shape[2]
        self.keys = mx.concatenate([self.keys, mx.zeros((N, H, grow, Dk), self.keys.dtype)], 2)
        self.values = mx.concatenate(
            [self.values, mx.zeros((N, H, grow, Dv), self.values.dtype)], 2
        )

    # -- mlx-lm's cache protocol -----------------------------------------------------------------
    def prepare(self, *, lengths: int | Sequence[int] | mx.array | None = None, **_: Any) -> None:
        """Make the next :meth:`update_and_fetch` advance row i by ``lengths[i]`` only.

        All L new positions are still written (rows are rectangular); each row keeps the first
        ``lengths[i]`` of them and the rest lie past its end, masked and later overwritten. Used
        for ragged appends, e.g. each slot adding its own number of verified context rows.
        """
        if self.lagged and isinstance(lengths, mx.array):
            self._advance = lengths  # counts the host has not read
            return
        self._advance = None if lengths is None else _per_row(lengths, self.rows, "lengths")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write ``keys``/``values`` (N, H, L, D) at each row's offset; return the used buffer.

        Returns:
            ``(keys, values)`` (N, H, K, D) with K = the largest row end after the write;
            row i's valid entries are ``[0, offset[i])`` (callers mask the rest).
        """
        N, _, L, _ = keys.shape
        if self.rows != N:
            raise ValueError(f"this cache has {self.rows} rows, got keys for {N}")
        used = max(self.lengths) + L
        view = bucketed(used, self.bucket) if L > 1 else used  # what make_mask(L) covers
        self._reserve(view, keys, values)
        if self.aligned:  # every row at the same position: a plain slice write
            n = self.lengths[0]
            self.keys[..., n : n + L, :] = keys
            self.values[..., n : n + L, :] = values
        elif N == 1 and not kv_row_scatter():  # one row, a position only the device knows
            self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
            self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        else:  # each row at its own position: a scatter (positions made once for all layers)
            offset = self.offset
            pos = _SHARED.get(
                ("pos", offset, L),
                lambda: (
                    offset[:, None, None, None] + mx.arange(L, dtype=mx.int32)[None, None, :, None]
                ),
            )
            at_k = _SHARED.get(("at", pos, keys.shape), lambda: mx.broadcast_to(pos, keys.shape))
            at_v = _SHARED.get(
                ("at", pos, values.shape), lambda: mx.broadcast_to(pos, values.shape)
            )
            self.keys = mx.put_along_axis(self.keys, at_k, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at_v, values, axis=2)
        self.written(L)
        return self.keys[..., :view, :], self.values[..., :view, :]

    def reserve_block(self, L: int, grow: Callable[[int, int], int] | None = None) -> None:
        """Make room for a write of ``L`` positions at every row's offset, as
        :meth:`update_and_fetch` does before writing (for a caller that writes the buffers
        itself: ``hf2q.kernels.forward.CompiledVerify``, then :meth:`written`). ``grow(need,
        capacity)``: the size to grow to when the buffer is too small (default: ``need``, in
        steps of :attr:`step`)."""
        used = max(self.lengths) + L
        need = bucketed(used, self.bucket) if L > 1 else used
        if grow is not None and need > self.capacity:
            need = grow(need, self.capacity)
        self._reserve(need, self.keys, self.values)

    def prepared(self, L: int) -> mx.array:
        """The counts (rows,) int32 the next write of ``L`` positions advances the rows by (what
        :meth:`prepare` set, else ``L`` each), for a caller that writes the buffers itself
        (``hf2q.runtime.draft_graph.CompiledDraft``, then :meth:`written`)."""
        adv = self._advance
        if isinstance(adv, mx.array):
            return adv if adv.dtype == mx.int32 else adv.astype(mx.int32)
        return _offsets(_check_prepared(adv, L) if adv is not None else [L] * self.rows)

    def written(self, L: int) -> None:
        """Advance the rows after ``L`` positions were written at their offsets: each row by its
        prepared length (:meth:`prepare`) or by ``L``."""
        N = self.rows
        adv = self._advance if self._advance is not None else [L] * N
        self._advance = None
        if isinstance(adv, mx.array):  # lagged: the offsets move on the device, the bound by L
            grow = [L] * N
        else:
            grow = _check_prepared(adv, L)
        self.lengths = [n + g for n, g in zip(self.lengths, grow)]
        self._grown = [n + g for n, g in zip(self._grown, grow)]
        self.offset = _moved(self.offset, 1, adv)

    def keys_and_values(self) -> tuple[mx.array, mx.array] | tuple[None, None]:
        """The used buffer (N, H, max(lengths), D); row i's valid entries are ``[0, offset[i])``."""
        if self.keys is None:
            return None, None
        used = max(self.lengths)
        return self.keys[..., :used, :], self.values[..., :used, :]

    @property
    def aligned(self) -> bool:
        """True when every row holds the same number of positions (never known when lagged)."""
        return not self.lagged and len(set(self.lengths)) == 1

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> mx.array | str | None:
        """Boolean mask (rows, 1, N, K) for N new positions per row, K = max(lengths) + N.

        New position j of row i sits at ``offset[i] + j`` and sees the row's keys at positions
        ``<= offset[i] + j`` (and within ``window_size`` when given); keys past the row's own
        end (other rows' longer histories, stale tails) are never visible. When the rows are
        aligned this is plain causal attention, returned as mlx-lm does for ``KVCache``
        (None for one position, ``"causal"`` otherwise) so the fused attention path is used.
        With a ``bucket`` and N > 1, K is rounded up to the bucket and the mask is always an
        array (the keys :meth:`update_and_fetch` returns have that length).
        """
        padded = N > 1 and self.bucket is not None
        if self.aligned and window_size is None and not return_array and not padded:
            return None if N == 1 else "causal"
        K = max(self.lengths) + N
        if padded:
            K = bucketed(K, self.bucket)
        q = self.offset[:, None] + mx.arange(N, dtype=mx.int32)[None]  # (rows, N)
        return key_mask(q, K, window_size)[:, None]  # (rows, 1, N, K)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row (clamped per row); return ``n``."""
        if self.lagged:  # the rows hold at least the n positions just written
            self.offset = _moved(self.offset, -1, n)
            return n
        self.rollback([min(n, m) for m in self.lengths])
        return n

    def rollback(self, drop: int | Sequence[int] | mx.array) -> None:
        """Drop the last ``drop[i]`` positions of row i (ragged); nothing is moved or copied.

        Lagged (:attr:`lagged`), an array ``drop`` moves the offsets on the device only, unchecked
        (the caller computed it from this round's acceptance); ``lengths`` stay upper bounds.
        """
        if self.lagged and isinstance(drop, mx.array):
            self.offset = _moved(self.offset, -1, drop)
            return
        d = _per_row(drop, self.rows, "drop")
        if any(not 0 <= x <= n for x, n in zip(d, self.lengths)):
            raise ValueError(f"cannot drop {d} positions from rows holding {self.lengths}")
        if not any(d):
            return
        self.lengths = [n - x for n, x in zip(self.lengths, d)]
        self.offset = _moved(self.offset, -1, d)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values, self.offset]

    def mark(self) -> tuple[mx.array, list[int]]:
        """The offsets now (lazy) and the positions written so far, for a later :meth:`resync`."""
        return self.offset, list(self._grown)

    def resync(self, mark: tuple[mx.array, list[int]], exact: Sequence[int] | None = None) -> None:
        """Tighten ``lengths`` once the offsets of ``mark`` are computed: exact then, plus what
        was written since (the bounds of rounds still in flight). ``exact``: those offsets as
        the host read them already (else read here)."""
        offset, then = mark
        if exact is None:
            exact = [int(v) for v in offset.tolist()]
        self.lengths = [e + now - t for e, now, t in zip(exact, self._grown, then)]

    def settle(self, lengths: Sequence[int]) -> None:
        """End a lagged stretch whose exact lengths the host knows already (it read the counts
        the offsets moved by): ``lengths`` exact, offsets host constants again, so nothing waits
        for the device's own copy of them."""
        self.lagged = False
        self.lengths = [int(v) for v in lengths]
        self.offset = _offsets(self.lengths)

    # -- rows ------------------------------------------------------------------------------------
    def insert(self, row: int, keys: mx.array | None, values: mx.array | None, length: int) -> None:
        """Make row ``row`` hold exactly ``keys``/``values`` (1, H, >= length, D)[..., :length, :]."""
        if keys is None or length == 0:
            self._set_length(row, 0)
            return
        self._reserve(length, keys, values)
        self.keys[row : row + 1, :, :length] = keys[..., :length, :]
        self.values[row : row + 1, :, :length] = values[..., :length, :]
        self._set_length(row, length)

    def _set_length(self, row: int, length: int) -> None:
        self.lengths[row] = int(length)
        self.offset = _offsets(self.lengths)

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in this order); the others are dropped."""
        idx = mx.array(list(rows), dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.lengths = [self.lengths[r] for r in rows]
        self._grown = [self._grown[r] for r in rows]
        self.offset = _offsets(self.lengths)

    def row(self, row: int) -> tuple[mx.array, mx.array]:
        """Keys and values (1, H, length, D) that row ``row`` holds."""
        n = self.lengths[row]
        return self.keys[row : row + 1, :, :n], self.values[row : row + 1, :, :n]


def _gdn_insert(batched: ArraysCache, row: int, single: ArraysCache, rows: int) -> None:
    for e, value in enumerate(single.cache):
        if value is None:
            raise ValueError("insert() needs a prefilled Gated-DeltaNet cache (state is empty)")
        if batched.cache[e] is None:
            batched.cache[e] = mx.zeros((rows, *value.shape[1:]), dtype=value.dtype)
        batched.cache[e][row : row + 1] = value


class SlotTargetCache(TargetCache):
    """A target's per-layer caches for N rows, with ragged rollback and row insertion.

    Attention layers hold a :class:`SlotKVCache`, Gated-DeltaNet layers a
    :class:`~hf2q.runtime.cache.GDNRollbackCache` with N rows. A ``list``, so mlx-lm's own model
    call and ``TargetModel.forward`` / ``verify_forward`` accept it.
    """

    def __init__(self, caches: Iterable[Any], rows: int) -> None:
        super().__init__(caches)
        self.rows = rows

    @property
    def offset(self) -> int:  # the single-sequence property makes no sense with ragged rows
        raise AttributeError("a SlotTargetCache has one offset per row: use .lengths")

    @property
    def lengths(self) -> list[int]:
        """Positions held per row (from the first attention layer)."""
        for c in self:
            if isinstance(c, SlotKVCache):
                return list(c.lengths)
        raise ValueError("this target has no attention layer to read positions from")

    def rollback(self, n_keep: int | Sequence[int] | mx.array) -> list[int]:  # type: ignore[override]
        """Keep the first ``n_keep[i]`` positions of the last verify in row i (every layer).

        With :attr:`lagged` caches and an array ``n_keep`` (this round's acceptance, not read by
        the host), every layer is restored on the device and nothing is checked or returned.

        Returns:
            positions dropped per row (``T - n_keep[i]``).
        """
        T = self.pending
        if T == 0:
            raise RuntimeError("rollback() needs a verify forward first")
        if self.lagged and isinstance(n_keep, mx.array):
            keep_arr = n_keep.astype(mx.int32)
            gdn = [c for c in self if isinstance(c, GDNRollbackCache)]
            if not rollback_in_one_launch(gdn, keep_arr):
                for c in gdn:
                    c.rollback_rows(keep_arr)
            drop = T - keep_arr  # one graph node for every layer
            for c in self:
                if isinstance(c, SlotKVCache):
                    c.rollback(drop)
            self.pending = 0
            return []
        keep = _per_row(n_keep, self.rows, "n_keep")
        if any(not 1 <= k <= T for k in keep):
            raise ValueError(f"n_keep must be in 1..{T} per row, got {keep}")
        drop = [T - k for k in keep]
        uniform = len(set(keep)) == 1
        gdn = [c for c in self if isinstance(c, GDNRollbackCache)]
        done = keep != [T] * len(keep) and rollback_in_one_launch(gdn, keep)
        for c in self:
            if isinstance(c, GDNRollbackCache):
                if not done:
                    c.rollback(keep[0] if uniform else keep)
            elif isinstance(c, SlotKVCache):
                c.rollback(drop)
            else:
                raise TypeError(f"{type(c).__name__} cannot be rolled back per row")
        self.pending = 0
        return drop

    @property
    def lagged(self) -> bool:
        """Whether the attention layers' offsets may run ahead of the host (see
        :attr:`SlotKVCache.lagged`)."""
        return any(c.lagged for c in self if isinstance(c, SlotKVCache))

    def insert(self, row: int, single: Sequence[Any]) -> None:
        """Copy a one-sequence cache (e.g. a request prefilled alone) into row ``row``."""
        if self.pending:
            raise RuntimeError("insert() between a verify and its rollback is not allowed")
        for c, s in zip(self, single, strict=True):
            if isinstance(c, SlotKVCache):
                k, v = (s.keys, s.values) if s.keys is not None else (None, None)
                c.insert(row, k, v, int(s.offset))
            else:
                _gdn_insert(c, row, s, self.rows)

    def filter(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in this order) in every layer."""
        if self.pending:
            raise RuntimeError("filter() between a verify and its rollback is not allowed")
        for c in self:
            if isinstance(c, SlotKVCache):
                c.filter(list(rows))
            else:
                c.filter(mx.array(list(rows), dtype=mx.int32))
        self.rows = len(rows)


def make_slot_target_cache(target: Any, rows: int) -> SlotTargetCache:
    """Empty caches for ``rows`` slots of ``target`` (a ``TargetModel``), filled by ``insert``.

    Raises:
        ValueError: a layer whose mlx-lm cache is neither a KV cache nor a Gated-DeltaNet
            ``ArraysCache`` (e.g. rotating or quantized caches).
    """
    from mlx_lm.models.cache import KVCache

    caches: list[Any] = []
    bucket = sdpa_bucket()
    for c in target.make_cache():
        if type(c) is ArraysCache:
            caches.append(GDNRollbackCache(len(c.cache)))
        elif type(c) is KVCache:
            caches.append(SlotKVCache(rows, bucket))
        else:
            raise ValueError(f"slots do not support {type(c).__name__} layers")
    return SlotTargetCache(caches, rows)


def make_slot_draft_cache(drafter: Any, rows: int) -> list[SlotKVCache]:
    """One :class:`SlotKVCache` per drafter layer (verified context only, ragged per row)."""
    return [SlotKVCache(rows) for _ in drafter.layers]


def insert_draft_rows(cache: Sequence[SlotKVCache], row: int, single: Sequence[Any]) -> None:
    """Copy a one-sequence drafter cache (``KVCache`` per layer) into row ``row``."""
    for c, s in zip(cache, single, strict=True):
        c.insert(row, s.keys, s.values, int(s.offset))


__all__ = [
    "SlotKVCache",
    "SlotTargetCache",
    "insert_draft_rows",
    "make_slot_draft_cache",
    "make_slot_target_cache",
]
