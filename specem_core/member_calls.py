"""Calls to the members of one request: retried when they fail, the member excluded (and the
exclusion reported) when it keeps failing, the request failed only when no drafter is left.

A failing member never loses the user's answer silently: :class:`MemberCalls` keeps every
exclusion, which the result reports (``GenerationResult.excluded``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from specem_core.backends.base import Member, MemberSession
from specem_core.errors import AllMembersFailedError, InputError
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
    """

    def __init__(self, members: Sequence[Member], retries: int, parallel: bool | None) -> None:
        self.members = list(members)
        self.retries = retries
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
        for _attempt in range(self.retries + 1):
            if not pending:
                break
            outcomes = self.pool.map(fn, pending, self.members)
            bad_input = next((out for out in outcomes if isinstance(out, InputError)), None)
            if bad_input is not None:
                if stage == "open":  # nobody will use the sessions the other members opened
                    for out in [*results.values(), *outcomes]:
                        if isinstance(out, MemberSession):
                            with contextlib.suppress(Exception):
                                out.close()
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
            with contextlib.suppress(Exception):
                session.close()

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
            with contextlib.suppress(Exception):
                self.sessions.pop(i).close()
        self.pool.close()
