"""The bridge from the synchronous loop to asyncio: a request's events produced in a worker thread
and consumed by an event loop, with cancellation both ways.

The loop calls members that block (native decoding, HTTP); running it in a thread keeps the event
loop free. A consumer that stops early cancels the run after its current round; a consumer whose
event loop has closed stops the worker too.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Workers:
    """The worker threads of an engine's async requests, so that shutdown can wait for them."""

    def __init__(self) -> None:
        self._threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

    async def iterate(self, events: Iterator[T], cancelled: threading.Event) -> AsyncGenerator[T, None]:
        """``events`` produced in a new worker thread and yielded here as they come. Setting
        ``cancelled`` (done here when the consumer stops) ends the producer after its current
        item; ``events.close()`` then releases what it holds (the members' sessions) at once."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def send(item: tuple[str, Any]) -> bool:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                cancelled.set()
                return False

        def pump() -> None:
            try:
                for event in events:
                    if not send(("event", event)) or cancelled.is_set():
                        break
            except BaseException as exc:
                send(("error", exc))
            finally:
                close = getattr(events, "close", None)  # a generator's; a plain iterator has none
                if close is not None:
                    close()  # release the members' sessions now, not at garbage collection
                send(("end", None))

        # the caller's context variables (a server's request id in its log lines) follow the loop
        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(pump,), name="specem-astream", daemon=True
        )
        self._threads.add(worker)
        worker.start()
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "event":
                    yield payload
                elif kind == "error":
                    raise payload
                else:
                    break
        finally:
            cancelled.set()

    def join(self, deadline: float) -> None:
        """Wait until every worker has ended or ``deadline`` (``time.monotonic()``) passes."""
        for worker in list(self._threads):
            worker.join(max(0.0, deadline - time.monotonic()))

    def running(self) -> int:
        """Workers running now (a cancelled request's ends after its current item)."""
        return sum(1 for w in list(self._threads) if w.is_alive())

    def idle(self) -> bool:
        """Whether no worker is running."""
        return self.running() == 0
