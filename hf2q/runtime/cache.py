"""Target caches with exact rollback of a speculative verify.

What it does: :class:`GDNRollbackCache` is mlx-lm's ``ArraysCache(size=2)`` for a Gated-DeltaNet
layer (``[conv_state (B, K-1, C), recurrent_state (B, Hv, Dv, Dk) float32]``) that can also hold
the record of the last verify forward (the conv input window and the recurrent state after every
verified position, or for a final-state record (``hf2q.kernels.select.gdn_record``) the last
state and what a replay of the kept steps needs) and restore the state after any accepted prefix
with :meth:`rollback`.
:class:`TargetCache` is the per-layer cache list of a target (a ``list``, so mlx-lm's own forward
and ``generate_step`` accept it) with one :meth:`TargetCache.rollback` over all layers: attention
KV caches are trimmed, Gated-DeltaNet caches restored from their record (a copy, or a replay of
the recurrence over each row's kept steps). No layer is re-run.
:class:`BucketedKVCache` is mlx-lm's ``KVCache`` whose multi-token attention sees keys padded to
a bucket length (masked), so MLX's CUDA backend reuses one attention graph across rounds
(``hf2q.kernels.select.sdpa_bucket``).

What it does not do: run any layer (the verify forward that fills the records lives in
``hf2q.runtime.verify``) or decide how many tokens are accepted.

Rollback contract: after a verify of T positions, ``rollback(n_keep)`` with ``1 <= n_keep <= T``
leaves every layer's cache exactly as if only the first ``n_keep`` verified positions had been
processed (tested against a fresh plain run over the committed tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from hf2q.kernels import cuda_rollback
from hf2q.kernels.cuda_readback import host_ints
from hf2q.kernels.gdn import replay_layers
from hf2q.kernels.select import bucketed, rollback_kernel_enabled, sdpa_bucket


@dataclass
class GDNRecord:
    """What a verify forward of T positions leaves for rollback in one Gated-DeltaNet layer.

    Attributes:
        conv_input: (B, K-1+T, C) the conv state before the verify followed by the T new conv
            inputs; the conv state after n positions is ``conv_input[:, n : n + K - 1]``.
        states: the float32 recurrent state after each verified position: T arrays
            (B, Hv, Dv, Dk), or one array (B, T, Hv, Dv, Dk) (what the fused CUDA kernel writes),
            from which a ragged rollback is a single gather; with ``replay``, the state after
            the last position only (B, Hv, Dv, Dk).
        replay: for final-state records (``select.gdn_record`` "final"): each row's state
            after its own kept count, ``replay(keep (B,) int32)`` (replayed from the state
            before the verify, the same bits as a per-step record); None for per-step records.
        steps: T, for final-state records.
    """

    conv_input: mx.array
    states: list[mx.array] | mx.array
    replay: Callable[[mx.array], mx.array] | None = None
    steps: int = 0

    @property
    def stacked(self) -> bool:
        """Whether the per-step states are one array (what the one-launch rollback copies)."""
        return self.replay is None and isinstance(self.states, mx.array)

    @property
    def length(self) -> int:
        if self.replay is not None:
            return self.steps
        return int(self.states.shape[1]) if self.stacked else len(self.states)

    def after(self, n: int) -> mx.array:
        """The state (B, Hv, Dv, Dk) after the first ``n`` positions (``1 <= n <= T``)."""
        if self.replay is not None:
            B = self.conv_input.shape[0]
            return self.states if n == self.steps else self.replay(mx.full((B,), n, mx.int32))
        return self.states[:, n - 1] if self.stacked else self.states[n - 1]

    def rows_after(self, keep: mx.array, keep_list: Sequence[int] | None) -> mx.array:
        """Row b's state after its own first ``keep[b]`` positions: (B, Hv, Dv, Dk)
        (``keep_list``: the same counts on the host, or None when only the device has them)."""
        if self.replay is not None:
            return self.replay(keep)
        if self.stacked or keep_list is None:
            states = self.states if self.stacked else mx.stack(self.states, axis=1)
            idx = (keep - 1).reshape(-1, 1, 1, 1, 1)
            return mx.take_along_axis(states, idx, axis=1)[:, 0]
        return mx.stack([self.states[x - 1][b] for b, x in enumerate(keep_list)])


class GDNRollbackCache(ArraysCache):
    """mlx-lm's ``ArraysCache`` for a Gated-DeltaNet layer, plus the record of the last verify.

    Plain forwards (prefill, one-token steps) use it exactly like ``ArraysCache``: mlx-lm's own
    ``GatedDeltaNet.__call__`` reads and writes ``cache[0]`` / ``cache[1]``. A verify forward
    (``hf2q.runtime.verify``) additionally stores a :class:`GDNRecord`.
    """

    def __init__(self, size: int = 2, left_padding: list[int] | None = None) -> None:
        super().__init__(size, left_padding)
        self.record: GDNRecord | None = None

    def set_record(
        self,
        conv_input: mx.array,
        states: list[mx.array] | mx.array,
        replay: Callable[[mx.array], mx.array] | None = None,
        steps: int = 0,
    ) -> None:
        """Keep the record of a verify forward (called by the verify layer function; ``replay``
        and ``steps`` for a final-state record, see :class:`GDNRecord`)."""
        self.record = GDNRecord(conv_input, states, replay, steps)

    def rollback(self, n_keep: int | Sequence[int] | mx.array) -> None:
        """Restore the state after the first ``n_keep`` positions of the last verify.

        Args:
            n_keep: positions to keep, ``1..T``; an int, or one value per batch row (B,) for
                batched verifies whose rows accepted different counts.
        """
        rec = self.record
        if rec is None:
            raise RuntimeError("rollback() needs a verify forward first (no record is held)")
        T = rec.length
        K1 = rec.conv_input.shape[1] - T  # kernel size - 1
        if isinstance(n_keep, int):
            if not 1 <= n_keep <= T:
                raise ValueError(f"n_keep must be in 1..{T}, got {n_keep}")
            if n_keep == T:  # the forward already left the state after every position
                self.restore(None, None, 0)
                return
            conv = mx.contiguous(rec.conv_input[:, n_keep : n_keep + K1])
            self.restore(conv, rec.after(n_keep), T - n_keep)
            return
        keep_list = [int(x) for x in (n_keep.tolist() if isinstance(n_keep, mx.array) else n_keep)]
        if not all(1 <= x <= T for x in keep_list):
            raise ValueError(f"n_keep values must be in 1..{T}, got {keep_list}")
        self.rollback_rows(host_ints(keep_list), keep_list)

    def rollback_rows(self, keep: mx.array, keep_list: Sequence[int] | None = None) -> None:
        """:meth:`rollback` with one kept count per row (B,), unchecked: ``keep_list`` is the same
        counts on the host, or None where the host has not read them (lagged rounds)."""
        rec = self.record
        if rec is None:
            raise RuntimeError("rollback() needs a verify forward first (no record is held)")
        T = rec.length
        K1 = rec.conv_input.shape[1] - T
        pos = (keep[:, None] + mx.arange(K1))[..., None]  # (B, K-1, 1)
        conv = mx.take_along_axis(rec.conv_input, pos, axis=1)
        self.restore(conv, rec.rows_after(keep, keep_list), T - keep)

    def restore(self, conv: mx.array | None, state: mx.array | None, back: int | mx.array) -> None:
        """Install the states after the kept positions and drop the record.

        Args:
            conv, state: the conv state (B, K-1, C) and recurrent state (B, Hv, Dv, Dk) after
                the kept positions (None: the current ones are already those).
            back: positions dropped (int, or (B,) per row).
        """
        if conv is not None:
            self[0], self[1] = conv, state
        # Undo the part of ``advance(T)`` that covered the dropped positions (batched padding).
        if self.lengths is not None:
            self.lengths = self.lengths + back
        if self.left_padding is not None:
            self.left_padding = self.left_padding + back
        self.record = None

    def commit(self) -> None:
        """Drop the record (all verified positions kept); frees its memory."""
        self.record = None

    def extract(self, idx: int) -> GDNRollbackCache:
        cache = GDNRollbackCache(len(self.cache))
        cache.cache = [c[idx : idx + 1] if c is not None else None for c in self.cache]
        return cache


def rollback_in_one_launch(
    caches: Sequence[GDNRollbackCache], keep: int | Sequence[int] | mx.array
) -> bool:
    """Restore every layer of ``caches`` after its rows' kept positions in one CUDA launch.

    ``keep``: positions kept, one count for every batch row or one per row, already checked to
    be in ``1..T``. Returns False (and changes nothing) where the launch does not apply: off
    CUDA, ``HF2Q_ROLLBACK_KERNEL=0``, or records neither one stacked array of per-step states
    each nor final states with a replay each; the caller then rolls each layer back itself.
    Same bits as :meth:`GDNRollbackCache.rollback` (both copy, or both replay). Final-state
    records: the conv rows in one launch and the replays in another
    (:func:`hf2q.kernels.gdn.replay_layers`; one per layer where that does not apply).
    """
    if not caches or not rollback_kernel_enabled():
        return False
    recs = [c.record for c in caches]
    if any(r is None for r in recs):
        return False
    replay = all(r.replay is not None for r in recs)
    if not (replay or all(r.stacked for r in recs)):
        return False
    T = recs[0].length
    if any(r.length != T for r in recs):
        return False
    convs = [r.conv_input for r in recs]
    if isinstance(keep, int):
        keep = [keep] * convs[0].shape[0]
    lazy = isinstance(keep, mx.array)  # counts the host has not read (lagged rounds)
    keep_arr = keep.astype(mx.int32) if lazy else host_ints(keep)
    back: int | mx.array = T - keep_arr if lazy or len(set(keep)) > 1 else T - keep[0]
    if replay:
        # Final-state records: the kept conv rows of every layer in one launch, the states by
        # one replay launch for all layers (or one a layer where that does not apply), the
        # counts and dropped positions made once.
        if cuda_rollback.conv_supported(convs, keep_arr, T) is not None:
            return False
        conv_out = cuda_rollback.rollback_conv_cuda(convs, keep_arr, T)
        state_out = replay_layers([r.replay for r in recs], keep_arr)
        if state_out is None:
            state_out = [r.replay(keep_arr) for r in recs]
    else:
        states = [r.states for r in recs]
        if cuda_rollback.supported(convs, states, keep_arr) is not None:
            return False
        conv_out, state_out = cuda_rollback.rollback_cuda(convs, states, keep_arr)
    for c, conv, state in zip(caches, conv_out, state_out, strict=True):
        c.restore(conv, state, back)
    return True


def key_mask(q_pos: mx.array, K: int, window_size: int | None = None) -> mx.array:
    """Which of keys ``0..K-1`` each query sees: boolean (..., N, K) for positions ``q_pos`` (..., N).

    Causal (key position <= query position) and, with ``window_size``, within the window; keys
    past a query's own position (padding, stale rolled-back entries) are never visible.
    """
    k = mx.arange(K, dtype=mx.int32)
    q = q_pos[..., None]
    mask = k <= q
    if window_size is not None:
        mask = mask & (k > q - window_size)
    return mask


class BucketedKVCache(KVCache):
    """mlx-lm's ``KVCache`` whose attention over several new positions sees bucket-padded keys.

    For ``N > 1`` new positions, :meth:`make_mask` returns a boolean mask (N, K) and
    :meth:`update_and_fetch` returns keys/values (B, H, K, D) with ``K = offset + N`` rounded up
    to a multiple of ``bucket``: the positions past the sequence (zeros or stale rolled-back
    entries) are masked out, so the attention equals the unpadded one while its shapes stay the
    same for a bucket's worth of positions (see ``hf2q.kernels.select.sdpa_bucket`` for why).
    One new position (plain decoding) is exactly mlx-lm's. Every layer of a forward shares the
    mask made from the first layer's cache, which holds because all layers hold the same
    positions; callers must take the mask from ``make_mask`` (mlx-lm's models do).
    """

    #: Batch row b's key of position p sits at buffer index p (see
    #: ``hf2q.kernels.attention.reads_buffer_in_place``).
    positions_are_indices = True

    def __init__(self, bucket: int) -> None:
        super().__init__()
        if bucket < 1:
            raise ValueError(f"bucket must be positive, got {bucket}")
        self.bucket = int(bucket)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = super().update_and_fetch(keys, values)
        L = keys.shape[2]
        if L == 1 or self.bucket is None:  # one position, or inside unbucketed(): mlx-lm's
            return k, v
        K = bucketed(self.offset, self.bucket)
        have = self.keys.shape[2]
        if have < K:  # mlx-lm regrows from a trimmed length: top the buffer up to the bucket
            B, H, _, Dk = self.keys.shape
            Dv = self.values.shape[3]
            self.keys = mx.concatenate([self.keys, mx.zeros((B, H, K - have, Dk), k.dtype)], 2)
            self.values = mx.concatenate([self.values, mx.zeros((B, H, K - have, Dv), v.dtype)], 2)
        return self.keys[..., :K, :], self.values[..., :K, :]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs: Any
    ) -> Any:
        if N == 1 or self.bucket is None:
            return super().make_mask(
                N, return_array=return_array, window_size=window_size, **kwargs
            )
        K = bucketed(self.offset + N, self.bucket)
        return key_mask(self.offset + mx.arange(N, dtype=mx.int32), K, window_size)  # (N, K)


@contextmanager
def unbucketed(caches: Iterable[Any]) -> Iterator[None]:
    """Inside the block, attention caches with a key bucket attend over exactly the keys held.

    A prompt is prefilled into DFlash's (bucketed) cache and, for plain decoding, into mlx-lm's
    own: both must hold the same bits, or greedy DFlash stops being lossless. On MLX's CUDA
    backend a prompt chunk's attention over bucket-padded keys with an array mask rounds
    differently from mlx-lm's unpadded ``"causal"`` call (the random 4B-shaped pair on an H200:
    the first attention layer's cache differed, and the tokens from the first or fourth on;
    ``benchmarks/lossless_diag.py``, session 17). A prefill builds one graph per chunk shape
    anyway, so the bucket buys nothing there.
    """
    held = [(c, c.bucket) for c in caches if getattr(c, "bucket", None)]
    for c, _ in held:
        c.bucket = None
    try:
        yield
    finally:
        for c, b in held:
            c.bucket = b


class TargetCache(list):
    """The per-layer caches of a target (``GDNRollbackCache`` / ``KVCache``) with one rollback.

    A ``list`` of mlx-lm caches, so ``model(tokens, cache=target_cache)`` and mlx-lm's generation
    utilities accept it unchanged. :attr:`pending` is the length T of the last verify forward
    that has not been rolled back or committed yet.
    """

    def __init__(self, caches: Iterable[Any]) -> None:
        super().__init__(caches)
        self.pending = 0

    @property
    def offset(self) -> int:
        """Positions held (from the first attention cache; Gated-DeltaNet caches have no offset)."""
        for c in self:
            if hasattr(c, "offset"):
                return int(c.offset)
        raise ValueError("this target has no attention layer to read the position from")

    def begin_verify(self, length: int) -> None:
        """Mark that a verify forward of ``length`` positions is about to run."""
        if self.pending:
            raise RuntimeError(
                "the previous verify was neither rolled back nor committed: call rollback(n_keep)"
            )
        self.pending = int(length)

    def rollback(self, n_keep: int) -> int:
        """Keep the first ``n_keep`` positions of the last verify in every layer; return how many
        positions were dropped (``T - n_keep``)."""
        T = self.pending
        if T == 0:
            raise RuntimeError("rollback() needs a verify forward first")
        if not 1 <= n_keep <= T:
            raise ValueError(f"n_keep must be in 1..{T}, got {n_keep}")
        drop = T - n_keep
        gdn = [c for c in self if isinstance(c, GDNRollbackCache)]
        done = bool(drop) and rollback_in_one_launch(gdn, n_keep)
        for c in self:
            if isinstance(c, GDNRollbackCache):
                if not done:
                    c.rollback(n_keep)
            elif drop:
                if not c.is_trimmable():
                    raise TypeError(f"{type(c).__name__} cannot be rolled back")
                c.trim(drop)
        self.pending = 0
        return drop

    def commit(self) -> None:
        """Keep every position of the last verify (same as ``rollback(T)``)."""
        if self.pending:
            self.rollback(self.pending)

    @property
    def state(self) -> list[Any]:
        """Arrays to evaluate so the caches are materialised (``mx.eval(cache.state)``)."""
        return [c.state for c in self]


def make_target_cache(model: Any) -> TargetCache:
    """The target's mlx-lm cache list with Gated-DeltaNet layers as :class:`GDNRollbackCache`.

    Attention layers get a :class:`BucketedKVCache` where ``sdpa_bucket()`` asks for one (CUDA).

    Args:
        model: an mlx-lm model (``model.make_cache()``), or a ``TargetModel``.
    """
    from mlx_lm.models.cache import make_prompt_cache

    base = model.make_cache() if hasattr(model, "make_cache") else make_prompt_cache(model)
    bucket = sdpa_bucket()

    def convert(c: Any) -> Any:  # exact types: subclasses keep their own behaviour
        if type(c) is ArraysCache:
            return GDNRollbackCache(len(c.cache))
        if type(c) is KVCache and bucket:
            return BucketedKVCache(bucket)
        return c

    return TargetCache(convert(c) for c in base)
