"""The server's bearer key: compared in constant time, never echoed, logged or shown in ``repr``."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from specem_integrations.server._errors import unauthorized


class BearerAuth:
    """``Authorization: Bearer <key>`` on the routes that need it (none without a key).

    Raises:
        ValueError: an empty ``api_key`` (``None`` means no authentication).
    """

    def __init__(self, api_key: str | None) -> None:
        if api_key is not None and not api_key:
            raise ValueError("api_key must be non-empty (or None for no authentication)")
        self._key = api_key.encode() if api_key is not None else None

    @property
    def enabled(self) -> bool:
        """Whether a key is needed."""
        return self._key is not None

    def check(self, request: Request) -> None:
        """Raises:
        APIError: 401 ``invalid_api_key`` for a missing or wrong key.
        """
        if self._key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        missing = scheme.lower() != "bearer" or not token
        if missing or not hmac.compare_digest(token.encode(), self._key):
            raise unauthorized(missing=missing)

    def __repr__(self) -> str:
        return f"BearerAuth({'on' if self.enabled else 'off'})"
