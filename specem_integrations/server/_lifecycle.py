"""The app's life after start: readiness (probes), draining from the first SIGTERM / SIGINT, the
end of the answers still in flight when the grace period runs out, and the wait for the engine's
threads after the shutdown (what :func:`~specem_integrations.server.run.run_server` calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from specem_core.backends.base import Member
from specem_core.engine import SpecEM
from specem_integrations.server._readiness import Readiness


class Lifecycle:
    """Readiness and shutdown of one app.

    Args:
        engine: the served engine (its threads are waited for after the shutdown).
        members: the members to probe (:class:`Readiness`).
    """

    def __init__(self, engine: SpecEM, members: Sequence[Member]) -> None:
        self._engine = engine
        self.readiness = Readiness(members)
        self.stopping = asyncio.Event()
        """Set when the shutdown grace period runs out: answers in flight end with an error."""
        self._loop: asyncio.AbstractEventLoop | None = None

    def serving_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the requests run on (:meth:`end_answers_after` schedules on it)."""
        self._loop = loop

    def end_answers_after(self, seconds: float) -> None:
        """End the answers still in flight ``seconds`` from now (thread- and signal-safe): a stream
        gets a ``server_shutting_down`` error event and ``[DONE]``, a JSON request a 503."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, max(0.0, seconds), self.stopping.set)

    def begin_draining(self) -> None:
        """Shutdown has begun (thread- and signal-safe): ``/health/ready`` answers 503 from now on."""
        self.readiness.begin_draining()

    def wait_idle(self, timeout: float) -> bool:
        """After the shutdown: wait (at most ``timeout`` seconds) until the engine's request threads
        have stopped and the members' background work is done. Returns whether all of it ended."""
        return self._engine.wait_idle(timeout)
