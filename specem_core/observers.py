"""Observers of an engine's member calls: what a server counts (open sessions), what metrics and
traces time (each draft, score, commit and open), without wrapping the members.

Register a :class:`MemberObserver` on the engine (``SpecEM(..., observers=[obs])`` or
``remover = engine.add_observer(obs)``); :class:`~specem_core.member_calls.MemberCalls` tells it
about every session it opens and closes and every call it makes to a member. An engine without
observers does none of this work.

Observers are called from the engine's threads (a request's worker thread, the member pool's
threads, several requests at once), so they must be thread-safe and quick. One that raises is
logged and skipped: it never fails a request.

Example:
    >>> class Timer(MemberObserver):                                  # doctest: +SKIP
    ...     def call_finished(self, call: MemberCall) -> None:
    ...         print(call.member, call.stage, f"{call.seconds:.3f}s")
    >>> engine = SpecEM(members, observers=[Timer()])                 # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["MemberCall", "MemberObserver", "Observers"]

logger = logging.getLogger("specem")


@dataclass(frozen=True)
class MemberCall:
    """One call the engine made to a member (one attempt: a retried call is several)."""

    member: str
    """The member's name."""
    stage: str
    """``open`` (opening its session), ``draft``, ``score`` or ``commit``."""
    round: int
    """The round (1-based; 0 for the calls before the first round: opening, a forced start)."""
    attempt: int
    """0 for the first attempt, then 1, 2, … for retries (``SpecEMConfig.member_retries``)."""
    started: float
    """When it started, on :func:`time.perf_counter`'s clock."""
    seconds: float
    """Its wall time."""
    error: BaseException | None = None
    """What it raised (the engine retries it, then excludes the member), or ``None``."""

    @property
    def ended(self) -> float:
        """When it ended, on :func:`time.perf_counter`'s clock."""
        return self.started + self.seconds


@runtime_checkable
class MemberObserver(Protocol):
    """What the engine tells about its member calls. Subclass it to get no-op defaults and
    override what you need; every method is called from the engine's threads (be thread-safe)."""

    def session_opened(self, member: str) -> None:
        """A request opened a session on ``member`` (one per member per request)."""
        return None

    def session_closed(self, member: str) -> None:
        """A session on ``member`` was closed (its request ended, failed or was cancelled, or the
        member was excluded from it); called once per opened session."""
        return None

    def call_finished(self, call: MemberCall) -> None:
        """A call to a member ended (returned or raised), in the thread that made it."""
        return None


class Observers:
    """The observers registered on one engine (thread-safe); iterating gives a snapshot."""

    def __init__(self, observers: Iterable[MemberObserver] = ()) -> None:
        self._lock = threading.Lock()
        self._observers: tuple[MemberObserver, ...] = ()
        for observer in observers:
            self.add(observer)

    def add(self, observer: MemberObserver) -> Callable[[], None]:
        """Register ``observer``; returns a function that removes it again (idempotent)."""
        if not isinstance(observer, MemberObserver):
            raise TypeError(f"{observer!r} is not a MemberObserver (session_opened, session_closed, call_finished)")
        with self._lock:
            self._observers = (*self._observers, observer)

        def remove() -> None:
            with self._lock:
                kept = list(self._observers)
                if observer in kept:
                    kept.remove(observer)
                self._observers = tuple(kept)

        return remove

    def __iter__(self) -> Iterator[MemberObserver]:
        return iter(self._observers)

    def __len__(self) -> int:
        return len(self._observers)

    def __bool__(self) -> bool:
        return bool(self._observers)


def notify(observers: Iterable[MemberObserver], tell: Callable[[MemberObserver], None]) -> None:
    """``tell(observer)`` for each observer; one that raises is logged and skipped."""
    for observer in observers:
        try:
            tell(observer)
        except Exception:
            logger.warning("member observer %r failed; ignored", observer, exc_info=True)
