"""Calls to the members of one request: retried when they fail, the member excluded (and the
exclusion reported) when it keeps failing, the request failed only when no drafter is left.

A failing member never loses the user's answer silently: :class:`MemberCalls` keeps every
exclusion, which the result reports (``GenerationResult.excluded``).

The engine's observers (:mod:`specem_core.observers`) hear of every session opened and closed
here and of every call made; without observers no call is wrapped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from specem_core.backends.base import Member, MemberSession
from specem_core.errors import AllMembersFailedError, InputError
from specem_core.observers import MemberCall, MemberObserver, notify
from specem_core.pool import MemberPool
from specem_core.types import Exclusion

T = TypeVar("T")


class MemberCalls:
    """The members' sessions of one request, and every call made to them.

    Args:
        members: the engine's members (indices are positions in this list).
        retries: retries of a failing call before its member is excluded
            (``SpecEMConfig.member_retries``).
        parallel: ``SpecEMConfig.parallel`` (members on different devices or servers run at once).
        observers: the engine's observers (:class:`~specem_core.observers.MemberObserver`; a
            snapshot is taken: one registered during the request hears of the next one).
    """

    def __init__(
        self,
        members: Sequence[Member],
        retries: int,
        parallel: bool | None,
        observers: Iterable[MemberObserver] = (),
    ) -> None:
        self.members = list(members)
        self.retries = retries
        self.observers = tuple(observers)
        self.pool = MemberPool(self.members, parallel)
        self.sessions: dict[int, MemberSession] = {}
        """The open sessions by member index; an excluded member's is closed and removed."""
        self.excluded: list[Exclusion] = []
        """Members dropped from the request, in order, with the stage and the error."""

    def call(self, stage: str, indices: Sequence[int], fn: Callable[[int], T], round_index: int) -> dict[int, T]:
        """``fn(i)`` for each member index, retrying failures and excluding members that keep
        failing; the results by index (an excluded member has none).

        Raises:
            InputError: the user's input, not a member, is at fault (nothing is excluded).
        """
        results: dict[int, T] = {}
        pending = list(indices)
        errors: dict[int, BaseException] = {}
        for attempt in range(self.retries + 1):
            if not pending:
                break
            call = self.observed(fn, stage, round_index, attempt) if self.observers else fn
            outcomes = self.pool.map(call, pending, self.members)
            if stage == "open" and self.observers:
                for i, out in zip(pending, outcomes, strict=True):
                    if not isinstance(out, BaseException):
                        self.opened(i)
            bad_input = next((out for out in outcomes if isinstance(out, InputError)), None)
            if bad_input is not None:
                if stage == "open":  # nobody will use the sessions the other members opened
                    for i, out in [*results.items(), *zip(pending, outcomes, strict=True)]:
                        if isinstance(out, MemberSession):
                            self.close_session(i, out)
                raise bad_input
            retry: list[int] = []
            for i, out in zip(pending, outcomes, strict=True):
                if isinstance(out, BaseException):
                    errors[i] = out
                    retry.append(i)
                else:
                    results[i] = out
            pending = retry
        for i in pending:
            self.exclude(i, stage, f"{type(errors[i]).__name__}: {errors[i]}", round_index)
        return results

    def exclude(self, i: int, stage: str, reason: str, round_index: int) -> None:
        """Drop member ``i`` from the request (closing its session) and record why."""
        self.excluded.append(Exclusion(self.members[i].name, stage, reason, round_index))
        session = self.sessions.pop(i, None)
        if session is not None:
            self.close_session(i, session)

    def active(self) -> list[int]:
        """The members still in the request, in member order."""
        return sorted(self.sessions)

    def require_drafter(self) -> None:
        """Raises:
        AllMembersFailedError: no member that can draft is left (the message names every exclusion).
        """
        if not any(self.members[i].can_draft for i in self.sessions):
            reasons = "; ".join(f"{e.member} ({e.stage}): {e.error}" for e in self.excluded)
            raise AllMembersFailedError(f"every drafting member failed: {reasons or 'no drafter left'}", self.excluded)

    def close(self) -> None:
        """Close every session and the worker threads."""
        for i in list(self.sessions):
            self.close_session(i, self.sessions.pop(i))
        self.pool.close()

    def close_session(self, i: int, session: MemberSession) -> None:
        """Close member ``i``'s ``session`` (its errors are ignored) and tell the observers."""
        try:
            with contextlib.suppress(Exception):
                session.close()
        finally:
            if self.observers:
                name = self.members[i].name
                notify(self.observers, lambda o: o.session_closed(name))

    # -- observers -------------------------------------------------------------------------------
    def opened(self, i: int) -> None:
        """Member ``i``'s session is open: tell the observers."""
        name = self.members[i].name
        notify(self.observers, lambda o: o.session_opened(name))

    def observed(self, fn: Callable[[int], T], stage: str, round_index: int, attempt: int) -> Callable[[int], T]:
        """``fn``, timed: each call is reported to the observers from the thread that made it."""

        def timed(i: int) -> T:
            error: BaseException | None = None
            started = time.perf_counter()
            try:
                return fn(i)
            except BaseException as exc:
                error = exc
                raise
            finally:
                call = MemberCall(
                    self.members[i].name, stage, round_index, attempt, started, time.perf_counter() - started, error
                )
                notify(self.observers, lambda o: o.call_finished(call))

        return timed
