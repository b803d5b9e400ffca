"""Request ids: ``X-Request-ID`` taken from the client (when valid) or made here, returned on every
response, and carried by a context variable into every log line written while the request runs.

The engine runs a request in a worker thread and its members' calls in a thread pool; both run in
a copy of the caller's context (``specem_core``), so a line logged by a member's HTTP client on
behalf of a request carries that request's id too.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_LENGTH = 128
_VALID = re.compile(rf"[A-Za-z0-9._:/+=@~-]{{1,{MAX_REQUEST_ID_LENGTH}}}")
"""A client's id is kept when it is 1-128 characters of letters, digits and ``. _ : / + = @ ~ -``:
UUIDs, ULIDs, nginx's ``$request_id``, base64 and trace ids pass; spaces, quotes and control
characters (which could forge log lines) do not."""

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("specem_request_id", default=None)
"""The id of the request being served in this context (``None`` outside a request)."""


def new_request_id() -> str:
    """A fresh request id: 32 hex digits."""
    return uuid.uuid4().hex


def valid_request_id(value: str | None) -> bool:
    """Whether a client's ``X-Request-ID`` is kept (see the allowed characters above)."""
    return value is not None and _VALID.fullmatch(value) is not None


def request_id_of(scope: Scope) -> str | None:
    """The id :class:`RequestIdMiddleware` gave this request (``None`` before it ran)."""
    state = scope.get("state")
    value = state.get("request_id") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


class RequestIdMiddleware:
    """ASGI middleware: picks the request's id, sets :data:`current_request_id` while the request
    runs, stores it in ``scope["state"]["request_id"]`` and adds ``X-Request-ID`` to the response.

    A client's id that is not valid is replaced by a fresh one (logged at debug level): an id is a
    correlation aid, not worth refusing a request over.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER.encode())
        request_id = given if given is not None and valid_request_id(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = current_request_id.set(request_id)
        if given is not None and given != request_id:
            logging.getLogger("specem.server").debug(
                "ignored an invalid X-Request-ID (%d characters); using a new id", len(given)
            )

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            try:
                return bytes(value).decode("latin-1").strip()
            except (TypeError, ValueError):
                return None
    return None


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (the current request's, or ``None``) to every record a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id.get()
        return True


def log_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call added with ``extra=`` (everything not a standard record attribute)."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


_STANDARD = frozenset(
    set(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)))
    | {"message", "asctime", "request_id", "color_message", "taskName"}
)
