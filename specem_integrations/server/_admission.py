"""Bounded concurrency with a bounded FIFO queue, and the counters ``/health`` reports."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any


class QueueFullError(Exception):
    """Every slot is taken and the waiting queue is full."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"queue full; retry after {retry_after}s")
        self.retry_after = retry_after


class Admission:
    """At most ``max_concurrency`` requests run; at most ``queue`` more wait, first come first served.

    Must be used from one event loop. A waiter that is cancelled (client gone, timeout) leaves the
    queue; a slot handed to a waiter that was cancelled at the same moment is passed on.
    """

    def __init__(self, max_concurrency: int, queue: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if queue < 0:
            raise ValueError(f"queue must be >= 0, got {queue}")
        self.max_concurrency = max_concurrency
        self.queue = queue
        self._running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._recent_seconds: float | None = None  # moving average of slot hold times

    @property
    def running(self) -> int:
        """Requests holding a slot."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests in the queue."""
        return sum(1 for w in self._waiters if not w.done())

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about one average request per queued round."""
        per_request = self._recent_seconds if self._recent_seconds is not None else 1.0
        rounds = (self.waiting + 1) / self.max_concurrency
        return max(1, min(600, math.ceil(per_request * rounds)))

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if needed.

        Raises:
            QueueFullError: no free slot and the queue is full (nothing is taken).
        """
        if self._running < self.max_concurrency and not self.waiting:
            self._running += 1
            return
        if self.waiting >= self.queue:
            raise QueueFullError(self.retry_after())
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # the slot arrived as we were cancelled
                self.release(None)
            else:
                waiter.cancel()
                self._discard(waiter)
            raise

    def release(self, seconds: float | None) -> None:
        """Give a slot back (``seconds``: how long it was held, for ``Retry-After``)."""
        if seconds is not None:
            previous = self._recent_seconds
            self._recent_seconds = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the next waiter: _running is unchanged
                return
        self._running = max(0, self._running - 1)

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)


@dataclass
class Stats:
    """Request counters (thread-safe; read by ``/health``)."""

    received: int = 0
    """Requests counted here: every ``POST /v1/chat/completions``, and a ``/v1/models`` request
    refused for its key. Each one ends in exactly one of the outcome counters below, so with
    nothing running or queued ``received == completed + cancelled + timed_out + rejected + failed +
    invalid`` (and, at any time, the difference is ``requests_in_flight + requests_queued`` plus
    requests still being read)."""
    started: int = 0
    """Requests admitted to a slot (not an outcome: each also ends in one of the counters below;
    a request refused before a slot, 429 or 4xx, is never started)."""
    completed: int = 0
    cancelled: int = 0
    """The client went away before the answer was complete (while queued, too)."""
    timed_out: int = 0
    """The request timeout ran out (while queued, too)."""
    rejected: int = 0
    """Answered 429 (queue full): never started."""
    failed: int = 0
    """Answered 5xx after admission."""
    invalid: int = 0
    """Answered 4xx: before admission (bad request, auth, unknown model), or after it when the
    engine refuses the input (``context_length_exceeded``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        """Increment one counter."""
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def to_dict(self) -> dict[str, Any]:
        """The counters as plain JSON."""
        with self._lock:
            return {
                "received": self.received,
                "started": self.started,
                "completed": self.completed,
                "cancelled": self.cancelled,
                "timed_out": self.timed_out,
                "rejected": self.rejected,
                "failed": self.failed,
                "invalid": self.invalid,
            }
