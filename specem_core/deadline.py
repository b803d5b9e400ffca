"""A request's time limit on the engine's event streams, checked as each segment is committed
(the adapters' ``timeout``, per instance or per call)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from specem_core.errors import ConfigError
from specem_core.types import StreamEvent


def timeout_of(value: Any, default: float | None, *, where: str) -> float | None:
    """A per-call ``timeout`` (seconds), else ``default``.

    Raises:
        ConfigError: not a positive number.
    """
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where}: timeout must be a positive number of seconds, got {value!r}")
    return float(value)


def within(events: Iterator[StreamEvent], timeout: float | None, *, where: str) -> Iterator[StreamEvent]:
    """``events`` until the last one, raising ``TimeoutError`` once ``timeout`` seconds have passed;
    the stream is closed however it ends (the members' caches are freed)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for event in events:
            yield event
            if not event.done and deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{where} did not finish within timeout={timeout}s")
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


async def awithin(
    events: AsyncIterator[StreamEvent], timeout: float | None, *, where: str
) -> AsyncIterator[StreamEvent]:
    """Async :func:`within`: a wait for the next segment is cut off at the deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                event = await asyncio.wait_for(anext(events), remaining)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise TimeoutError(f"{where} did not finish within timeout={timeout}s") from exc
            yield event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
