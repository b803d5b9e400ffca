"""Typed errors of server members (httpx's ``_exceptions.py``, for SpecEM's HTTP backend).

Every error is a :class:`~specem_core.errors.SpecEMError`; the engine treats them like any other
member failure (retried per ``member_retries``, then the member is excluded from the request).
"""

from __future__ import annotations

from specem_core.errors import SpecEMError


# -- errors ---------------------------------------------------------------------------------
class HTTPMemberError(SpecEMError, RuntimeError):
    """A request to a member's server failed (after its retries) or returned something unusable."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerResponseError(HTTPMemberError):
    """The server answered 2xx, but with malformed JSON or an unexpected shape."""


class AlignmentError(HTTPMemberError):
    """Prompt log-probs could not be matched to the candidate's tokens with certainty."""


class CapabilityError(HTTPMemberError):
    """The server lacks what the member's draft / verify mode needs."""


class RequestCancelledError(HTTPMemberError):
    """The request was cancelled (``session.cancel()`` / ``close()``) before it finished."""


class ServerUnavailableError(HTTPMemberError):
    """Not sent: the server's circuit breaker is open (it failed repeatedly and its cool-down has
    not passed; see :class:`~specem_core.backends.http.client.BreakerPolicy`)."""
