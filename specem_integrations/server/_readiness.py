"""Readiness of ``specem serve``: members loaded (they are, once the app exists) and probed, and
not shutting down.

Members reached over HTTP (``openai:`` and ``judge:``) are probed once in a background thread as
the app is created (``GET /v1/models`` and the capability checks the member runs before its first
request anyway). The app is ready once every member's first probe has ended and at least one
drafting member is usable; a member whose probe failed is named in ``/health/ready`` and left to
the per-request path (it is probed again when a request opens it, and its circuit breaker skips it
while its server is down). While no drafter can be used the probes are retried, with a backoff.
Local members (llama.cpp, transformers) need no probe: loading them was the check.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from specem_core.backends.base import Member, ProbingMember

logger = logging.getLogger("specem.server")

_FIRST_RETRY = 1.0
_MAX_RETRY = 30.0


class Readiness:
    """Probes the members once, in the background, and says whether the app is ready.

    Args:
        members: the engine's members (a :class:`~specem_core.backends.base.ProbingMember` is probed).
    """

    def __init__(self, members: Sequence[Member]) -> None:
        self._members = list(members)
        self._lock = threading.Lock()
        self._status: dict[str, str] = {}
        """Per member: ``ok``, ``probing`` or the last probe's error (one line)."""
        self._drafters = {m.name for m in self._members if m.can_draft}
        self._probed = False
        self.draining = False
        """Set when shutdown begins: ``/health/ready`` answers 503 from then on."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for member in self._members:
            self._status[member.name] = "probing" if isinstance(member, ProbingMember) else "ok"
        if all(status == "ok" for status in self._status.values()):
            self._probed = True

    def start(self) -> None:
        """Start probing (once; nothing to do when no member needs a probe)."""
        with self._lock:
            if self._probed or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._probe_all, name="specem-readiness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop retrying probes (shutdown)."""
        self._stop.set()

    def begin_draining(self) -> None:
        """Shutdown has begun: answer 503 on ``/health/ready`` so that load balancers stop sending."""
        self.draining = True
        self.stop()

    @property
    def probed(self) -> bool:
        """Every member has been probed once and a drafter is usable."""
        with self._lock:
            return self._probed

    @property
    def ready(self) -> bool:
        """Probed and not draining."""
        return self.probed and not self.draining

    def members(self) -> dict[str, str]:
        """Per member: ``ok``, ``probing`` or the error of its last probe."""
        with self._lock:
            return dict(self._status)

    def state(self) -> str:
        """``ready``, ``draining``, ``probing`` (first probes under way) or ``unavailable`` (no drafter usable yet)."""
        if self.draining:
            return "draining"
        with self._lock:
            if self._probed:
                return "ready"
            return "probing" if any(s == "probing" for s in self._status.values()) else "unavailable"

    def _probe_all(self) -> None:
        delay = _FIRST_RETRY
        while not self._stop.is_set():
            for member in self._members:
                if isinstance(member, ProbingMember) and self._status_of(member.name) != "ok":
                    self._probe(member.name, member)
            with self._lock:
                usable = any(self._status[name] == "ok" for name in self._drafters)
                if usable or not self._drafters:
                    self._probed = True
                failed = {n: s for n, s in self._status.items() if s != "ok"}
            if usable:
                for name, error in failed.items():
                    logger.warning("member %s: its probe failed (%s); it is tried again per request", name, error)
                return
            logger.warning(
                "not ready: no drafting member answered its probe (%s); retrying in %.0fs",
                "; ".join(f"{n}: {s}" for n, s in failed.items()),
                delay,
            )
            if self._stop.wait(delay):
                return
            delay = min(_MAX_RETRY, delay * 2)

    def _status_of(self, name: str) -> str:
        with self._lock:
            return self._status[name]

    def _probe(self, name: str, member: ProbingMember) -> None:
        try:
            member.probe(scoring=len(self._drafters) >= 2)  # a member alone never scores
        except Exception as exc:
            lines = str(exc).strip().splitlines()
            status = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        else:
            status = "ok"
        with self._lock:
            self._status[name] = status
