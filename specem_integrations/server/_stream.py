"""One chat-completion request in flight: its state (:class:`Job`), the watch on its client's
connection, and the guard that ends its work when the client goes away, its deadline passes or
the server's shutdown grace period runs out (:func:`guarded`, :class:`EventStream` for SSE)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specem_core.types import GenerationResult, StreamEvent
from specem_integrations.server._errors import shutting_down
from specem_integrations.server._protocol import EngineCall, error_event, sse

T = TypeVar("T")

Outcome = Literal["completed", "cancelled", "timed_out", "failed", "invalid"]
"""How a request ended (the name of the ``/health`` counter it adds to)."""


class ClientGoneError(Exception):
    """The client closed the connection."""


class TimedOutError(Exception):
    """The per-request deadline passed."""


class DisconnectWatch:
    """Waits on the ASGI receive channel for ``http.disconnect`` (the body has been read already)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching (idempotent)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    async def stop(self) -> None:
        """Stop watching."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class ShuttingDownError(Exception):
    """The server's shutdown grace period ran out before the answer was done."""


async def guarded(
    work: Awaitable[T], watch: DisconnectWatch, deadline: float | None, stop: asyncio.Event | None = None
) -> T:
    """Await ``work`` unless the client goes away, the deadline passes or ``stop`` is set first;
    then ``work`` is cancelled (and awaited, so that what it held is released) and the reason raised."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(watch.gone.wait())
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        waits = {task, gone} if stopped is None else {task, gone, stopped}
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        reason: Exception = (
            ClientGoneError() if gone in done else ShuttingDownError() if stopped in done else TimedOutError()
        )
        raise reason
    finally:
        gone.cancel()
        if stopped is not None:
            stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass
class Job:
    """One admitted (or waiting) chat-completion request."""

    call: EngineCall
    request_id: str
    """The ``X-Request-ID`` (in the logs and error bodies)."""
    completion_id: str
    """The answer's ``id`` (``chatcmpl-…``)."""
    created: int
    arrived: float
    """Event-loop time of arrival (the timeout, the queue wait and the latencies count from it)."""
    deadline: float | None
    agen: AsyncIterator[StreamEvent] | None = None
    admitted_at: float | None = None
    first_segment_at: float | None = None
    result: GenerationResult | None = None
    outcome: Outcome = "failed"
    finished: bool = False


class EventStream(StreamingResponse):
    """An SSE response that stops as soon as the client goes away or the deadline passes."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        watch: DisconnectWatch,
        deadline: float | None,
        on_timeout: Callable[[], bytes],
        finish: Callable[[Outcome | None], Awaitable[None]],
        headers: dict[str, str],
        stop: asyncio.Event | None = None,
        on_stop: Callable[[], bytes] = lambda: error_event(shutting_down()),
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._watch = watch
        self._deadline = deadline
        self._on_timeout = on_timeout
        self._on_stop = on_stop
        self._finish = finish
        self._stop = stop

    async def _pump(self, send: Send) -> None:
        async for chunk in self.body_iterator:
            data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: Outcome | None = None  # None: as the body generator recorded it
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await guarded(self._pump(send), self._watch, self._deadline, self._stop)
        except (ClientGoneError, OSError):
            outcome = "cancelled"
        except ShuttingDownError:  # the answer ends with an error event, then [DONE]
            outcome = "cancelled"
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": self._on_stop(), "more_body": True})
                await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimedOutError:
            outcome = "timed_out"
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": self._on_timeout(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:  # server shutdown past its grace period
            outcome = "cancelled"
            raise
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with contextlib.suppress(BaseException):
                    await closer()
            await self._finish(outcome)
