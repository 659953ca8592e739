"""Where hf2q's decode loops evaluate their graphs: on the calling thread, or encoded on a worker
thread while the calling thread builds the next graph (``HF2Q_ENCODE_THREAD``).

Why: on an H200 a 4B-shaped DFlash round is bound by the host, not the device. The host builds
the round's graph in Python (about 3 ms: the verify's 32 layers, the draft) and then MLX encodes
its kernels (about 4.5 us a node, several hundred nodes); the two run one after the other on one
thread, and the device (about 5.8 ms of work) waits between rounds (docs/BENCHMARKS.md, sessions
15, 22 and 27). ``mx.eval`` / ``mx.async_eval`` release Python's GIL while MLX encodes, so a
second thread can encode round k+1 while the first builds round k+2.

How: :func:`encoded` drives a decode generator with an :class:`Encoder`: for every step of the
generator the calling thread's default stream is a stream MLX lets any thread evaluate
(``mx.new_thread_unsafe_stream``), and the loop's evaluations go through this module:

- :func:`enqueue` hands arrays to the worker (``mx.async_eval`` there) and returns a ticket;
- :func:`wait` blocks until a ticket's arrays are encoded, after which reading them (``tolist``,
  ``item``) only waits for the device, never encodes;
- :func:`evaluate` is ``mx.eval`` under the lock the worker encodes under, for everything the
  calling thread evaluates itself (prefill, one-off constants, synchronous rounds).

So exactly one thread encodes at a time (MLX's thread-unsafe streams leave that to the user),
and the values are the ones evaluating on one thread gives: the same graphs, evaluated in the
same order. Without an active encoder the three functions are ``mx.async_eval`` (ticket 0), a
no-op and ``mx.eval``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

import mlx.core as mx

T = TypeVar("T")

#: Held by whichever thread encodes: the worker for queued arrays, the calling thread in
#: :func:`evaluate`.
_LOCK = threading.Lock()
#: The encoder of the generator step running now (the decode loops run on one thread).
_active: Encoder | None = None
#: One thread-unsafe stream per device, made on first use (a new stream per run would leave
#: MLX's per-stream buffers behind).
_streams: dict[str, Any] = {}


class Encoder:
    """A worker thread that encodes queued arrays (``mx.async_eval``) in order, under the lock.

    Tickets count submissions: ticket n is done when the worker has encoded the n-th one. An
    exception raised while encoding is raised again by the next :meth:`wait`.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._sent = 0
        self._encoded = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="hf2q-encode", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            error = None
            try:
                with _LOCK:
                    mx.async_eval(job)
            except BaseException as e:  # handed to the waiting thread
                error = e
            del job
            with self._done:
                self._encoded += 1
                if error is not None and self._error is None:
                    self._error = error
                self._done.notify_all()

    def submit(self, arrays: list) -> int:
        self._sent += 1
        self._jobs.put(arrays)
        return self._sent

    def wait(self, ticket: int | None = None) -> None:
        """Until submission ``ticket`` (None: every one so far) is encoded."""
        ticket = self._sent if ticket is None else ticket
        with self._done:
            while self._encoded < ticket and self._error is None:
                self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Encode what is queued, then stop the worker."""
        self._jobs.put(None)
        self._thread.join()


def enqueue(*arrays: Any) -> int:
    """Queue ``arrays`` for evaluation without waiting: on the active encoder's worker (the
    returned ticket is for :func:`wait`), else ``mx.async_eval`` here (ticket 0)."""
    if _active is None:
        mx.async_eval(*arrays)
        return 0
    return _active.submit(list(arrays))


def wait(ticket: int) -> None:
    """Block until the arrays of ``ticket`` (from :func:`enqueue`) are encoded, so that reading
    them only waits for the device (no-op without an active encoder, or for ticket 0)."""
    if _active is not None and ticket:
        _active.wait(ticket)


def evaluate(*arrays: Any) -> None:
    """``mx.eval(*arrays)`` on this thread, under the worker's lock while an encoder is active."""
    if _active is None:
        mx.eval(*arrays)
        return
    with _LOCK:
        mx.eval(*arrays)


def clear_cache() -> None:
    """``mx.clear_cache()``, not while the worker encodes."""
    with _LOCK:
        mx.clear_cache()


def _stream() -> Any:
    device = mx.default_device()
    key = str(device)
    if key not in _streams:
        _streams[key] = mx.new_thread_unsafe_stream(device)
    return _streams[key]


def encoded(events: Iterator[T], enabled: bool | None = None) -> Iterator[T]:
    """Drive the decode generator ``events`` with its graphs encoded on a worker thread.

    ``enabled`` None: ``HF2Q_ENCODE_THREAD`` (:func:`hf2q.kernels.select.encode_thread_enabled`).
    Off, ``events`` itself is returned. On, every step of ``events`` runs with an
    :class:`Encoder` active and a stream any thread may evaluate as this thread's default; the
    caller's default stream is back between steps. Everything a step builds must be built by
    it: an unevaluated array made on another stream fails loudly in the worker ("no stream in
    current thread"), it is not silently evaluated elsewhere.
    """
    if enabled is None:
        from hf2q.kernels.select import encode_thread_enabled

        enabled = encode_thread_enabled()
    if not enabled:
        return events
    return _encoded(events)


def _encoded(events: Iterator[T]) -> Iterator[T]:
    global _active
    if _active is not None:  # already inside an encoded generator: its encoder serves
        yield from events
        return
    stream = _stream()
    before = mx.default_stream(mx.default_device())
    enc = Encoder()
    try:
        while True:
            mx.set_default_stream(stream)
            _active = enc
            try:
                item = next(events)
            except StopIteration:
                return
            finally:
                _active = None
                mx.set_default_stream(before)
            yield item
    finally:
        _active = enc
        mx.set_default_stream(stream)
        try:
            close = getattr(events, "close", None)
            if close is not None:
                close()
            enc.wait()
        finally:
            _active = None
            mx.set_default_stream(before)
            enc.close()
