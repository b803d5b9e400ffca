"""Count the member sessions the engine has open (``/health`` reports them).

The engine opens one session per member per request and closes them when the request ends,
is cancelled or fails. The server wraps each member so that this is observable from outside:
after a client disconnects, ``sessions_open`` must fall back to zero once the round in progress
ends. The wrapper forwards everything else to the member (weights stay shared).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from specem_core.backends.base import CachingSession, Member, MemberSession, SamplingParams, SessionRequest
from specem_core.types import Candidate, CandidateScore, Draft


class SessionCounter:
    """Open sessions per member, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self.opened_total = 0

    def opened(self, member: str) -> None:
        """A session was opened."""
        with self._lock:
            self._open[member] = self._open.get(member, 0) + 1
            self.opened_total += 1

    def closed(self, member: str) -> None:
        """A session was closed."""
        with self._lock:
            self._open[member] = max(0, self._open.get(member, 0) - 1)

    @property
    def open(self) -> int:
        """Sessions open now, all members together."""
        with self._lock:
            return sum(self._open.values())

    def per_member(self) -> dict[str, int]:
        """Sessions open now, per member."""
        with self._lock:
            return dict(self._open)


class CountedSession:
    """A member session that reports its ``close`` (once) to a :class:`SessionCounter`."""

    def __init__(self, inner: MemberSession, member: str, counter: SessionCounter) -> None:
        self._inner = inner
        self._member = member
        self._counter = counter
        self._closed = False
        self._lock = threading.Lock()
        counter.opened(member)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in the member's tokens."""
        return self._inner.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """Committed response length in the member's tokens."""
        return self._inner.completion_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the member read from its prefix cache (0 for members without one)."""
        return self._inner.cached_tokens if isinstance(self._inner, CachingSession) else 0

    @property
    def prefilled_tokens(self) -> int:
        """Tokens the member prefilled for this request (0 where it does not count them)."""
        return self._inner.prefilled_tokens if isinstance(self._inner, CachingSession) else 0

    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        """Forwarded to the member's session."""
        return self._inner.draft(max_tokens, sampling, hints=hints, score_eos=score_eos)

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Forwarded to the member's session."""
        return self._inner.score(candidates, score_eos=score_eos)

    def commit(self, text: str, *, final: bool = False) -> None:
        """Forwarded to the member's session."""
        self._inner.commit(text, final=final)

    def close(self) -> None:
        """Close the member's session and count it closed (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._inner.close()
        finally:
            self._counter.closed(self._member)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never forward private names (and no recursion before __init__ ran)
            raise AttributeError(name)
        return getattr(self._inner, name)


class CountedMember:
    """A member whose sessions are counted; every other attribute is the member's own."""

    def __init__(self, inner: Member, counter: SessionCounter) -> None:
        self._inner = inner
        self._counter = counter
        self.name = inner.name
        self.can_draft = inner.can_draft
        self.can_verify = inner.can_verify

    @property
    def inner(self) -> Member:
        """The wrapped member."""
        return self._inner

    @property
    def context_window(self) -> int | None:
        """The member's context window."""
        return self._inner.context_window

    @property
    def concurrency_key(self) -> str:
        """The member's concurrency key."""
        return self._inner.concurrency_key

    def open(self, request: SessionRequest) -> CountedSession:
        """Open a session on the member and count it."""
        return CountedSession(self._inner.open(request), self.name, self._counter)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never forward private names (and no recursion before __init__ ran)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"CountedMember({self._inner!r})"
