"""Count the member sessions the engine has open (``/health`` and ``/metrics`` report them).

The engine opens one session per member per request and closes them when the request ends,
is cancelled or fails; it tells its observers (:mod:`specem_core.observers`) each time. The
server registers a :class:`SessionCounter` on the engine it serves, so that this is observable
from outside: after a client disconnects, ``sessions_open`` must fall back to zero once the round
in progress ends.
"""

from __future__ import annotations

import threading

from specem_core.observers import MemberObserver


class SessionCounter(MemberObserver):
    """Open sessions per member, thread-safe (an observer of the engine's member calls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self.opened_total = 0

    def session_opened(self, member: str) -> None:
        """A session was opened."""
        with self._lock:
            self._open[member] = self._open.get(member, 0) + 1
            self.opened_total += 1

    def session_closed(self, member: str) -> None:
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

    def __repr__(self) -> str:
        return f"SessionCounter(open={self.open}, opened_total={self.opened_total})"
