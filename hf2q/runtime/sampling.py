"""Sampling for plain and speculative decoding: greedy, temperature / top-k / top-p, rejection sampling.

What it does: turn logits into the distribution a token is drawn from (:func:`probs`), draw
tokens with explicit, seeded ``mx.random`` keys (:class:`KeyStream`), and decide how many drafted
tokens a verify accepts: :func:`accept_greedy` (T = 0: leading drafts equal to the target's
argmax) and :func:`accept_rejection` (T > 0: exact rejection sampling, so committed tokens follow
the target's distribution). Everything stays on the device as lazy arrays; callers evaluate once.

What it does not do: run models or keep decoding state. Plain decoding and DFlash use these same
functions, so at T = 0 both pick the same tokens and at T > 0 both sample from the same ``p``.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023), for drafts d_1..d_n drawn from q_i::

    walk i = 1..n: accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    first reject at i: the bonus is drawn from norm(max(0, p_i - q_i))
    all accepted: the bonus is drawn from p_{n+1}
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from hf2q.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` is greedy (argmax); top-k/top-p then do nothing.

    Attributes:
        temperature: divides the logits; 0 means greedy.
        top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p`` (1 = all).
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        seed: seed of the random keys (None: drawn from the OS).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> SamplingParams:
        """Raise :class:`UsageError` naming the bad value; return self."""
        if not self.temperature >= 0:  # also catches NaN
            raise UsageError(f"--temp must be 0 (greedy) or positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        return self


class KeyStream:
    """A reproducible sequence of ``mx.random`` keys from one seed (no global RNG state)."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
        self._key = mx.random.key(self.seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def peek(self) -> mx.array:
        """The key :meth:`next` returns next, without taking it."""
        return mx.random.split(self._key)[1]


def probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """The sampling distribution (float32, rows sum to 1) of ``logits`` (..., V) for T > 0.

    Temperature first, then top-k on the scaled logits, then top-p on the resulting softmax,
    renormalised. Applied identically to target (p) and drafter (q) logits.
    """
    x = logits.astype(mx.float32) / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = mx.partition(x, V - params.top_k, axis=-1)[..., V - params.top_k, None]
        x = mx.where(x >= kth, x, -mx.inf)
    pr = mx.softmax(x, axis=-1)
    if params.top_p < 1:
        order = mx.argsort(-pr, axis=-1)
        sorted_p = mx.take_along_axis(pr, order, axis=-1)
        # Keep a token while the mass strictly before it is below top_p (the crossing one stays).
        keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < params.top_p
        keep = mx.put_along_axis(mx.zeros(pr.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
        pr = mx.where(keep, pr, 0.0)
        pr = pr / pr.sum(axis=-1, keepdims=True)
    return pr


def sample(pr: mx.array, key: mx.array) -> mx.array:
    """Draw one token per row of the distribution ``pr`` (..., V) -> (...) int32."""
    return mx.random.categorical(mx.log(pr), axis=-1, key=key).astype(mx.int32)


def choose(logits: mx.array, params: SamplingParams, keys: KeyStream | None) -> mx.array:
    """The next token of each row of ``logits`` (..., V): argmax at T = 0, else a draw from p."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    assert keys is not None
    return sample(probs(logits, params), keys.next())


def accept_greedy(
    draft: mx.array, target_choice: mx.array, limit: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """T = 0 acceptance, of one block or of a batch of rows (leading axes), each on its own.

    Args:
        draft: (..., n) drafted tokens d_1..d_n.
        target_choice: (..., n+1) the target's argmax at each verify position.
        limit: (...,) most drafts each row may accept (its own block is shorter), or None.

    Returns:
        ``(a, bonus)`` of shape (...,): ``a`` = leading drafts equal to the target's choice, and
        the target's choice at position ``a`` (the token committed after the accepted drafts).
    """
    n = draft.shape[-1]
    match = draft == target_choice[..., :n]
    if limit is not None:
        match = match & (mx.arange(n) < limit[..., None])
    a = mx.cumprod(match.astype(mx.int32), axis=-1).sum(axis=-1)
    return a, mx.take_along_axis(target_choice, a[..., None], axis=-1)[..., 0]


def point_masses(tokens: mx.array, vocab_size: int) -> mx.array:
    """(n, V) float32 distributions with all mass on ``tokens[i]``: the q of a deterministic
    proposal (a lookup draft), for which :func:`accept_rejection` keeps token i with
    probability p(token) and otherwise draws from p without it, renormalised: exactly p."""
    return (mx.arange(vocab_size)[None, :] == tokens[:, None]).astype(mx.float32)


def accept_rejection(
    draft: mx.array, q: mx.array, p: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """T > 0 acceptance by exact rejection sampling (see the module docstring).

    Args:
        draft: (n,) drafted tokens, ``draft[i]`` drawn from ``q[i]``.
        q: (n, V) drafter distributions (after :func:`probs`).
        p: (n+1, V) target distributions at the verify positions (after :func:`probs`).
        key: one random key; split here for the n uniforms and the bonus draw.

    Returns:
        ``(a, bonus)`` scalars as :func:`accept_greedy`.
    """
    n = draft.shape[0]
    k_accept, k_bonus = mx.random.split(key)
    idx = draft[:, None]
    p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(n,), key=k_accept)
    # u < p/q  <=>  u*q < p for q > 0 (every drafted token has q > 0).
    ok = (u * q_d < p_d).astype(mx.int32)
    a = mx.cumprod(ok).sum()
    q_pad = mx.concatenate([q, mx.zeros((1, q.shape[-1]), dtype=q.dtype)])
    p_a = mx.take(p, a, axis=0)
    resid = mx.maximum(p_a - mx.take(q_pad, a, axis=0), 0.0)
    total = resid.sum()
    # total == 0 only if p_a == q_a to rounding, where rejection has probability ~0: use p_a.
    resid = mx.where(total > 0, resid / mx.maximum(total, 1e-30), p_a)
    return a, sample(resid, k_bonus)
