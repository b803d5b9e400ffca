"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}, "request_id"}`` with a
status code (``request_id`` beside ``error``, as the response's ``X-Request-ID``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error the server answers with an OpenAI-shaped JSON body.

    Messages are written for the client: they never contain the API key, request headers or a
    traceback.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status (400, 401, 404, 413, 429, 500, 503, 504)."""
        self.message = message
        """What went wrong, for the client (``error.message``)."""
        self.type = type
        """OpenAI's error type (``error.type``): ``invalid_request_error``, ``authentication_error``, …"""
        self.param = param
        """The request parameter at fault, as the client wrote it (``error.param``), or ``None``."""
        self.code = code
        """A machine-readable reason (``error.code``): ``invalid_value``, ``rate_limit_exceeded``, …"""
        self.headers = dict(headers or {})
        """Extra response headers (``Retry-After`` on a 429 or 503)."""
        self.request_id: str | None = None
        """The request's id, added beside ``error`` in the body when set (the server sets it)."""

    def body(self) -> dict[str, Any]:
        """The JSON body (also used as the ``data:`` of an error event in a stream)."""
        body: dict[str, Any] = {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }
        if self.request_id is not None:
            body["request_id"] = self.request_id
        return body

    def response(self) -> JSONResponse:
        """The HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    """404 ``model_not_found`` (OpenAI's wording)."""
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def unauthorized(missing: bool) -> APIError:
    """401 for a missing or wrong bearer key (the key given is never echoed)."""
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        if missing
        else "Incorrect API key provided."
    )
    return APIError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def queue_full(retry_after: int) -> APIError:
    """429 with ``Retry-After``: every worker is busy and the waiting queue is full."""
    return APIError(
        429,
        "The server is at capacity (all workers busy and the queue is full); retry later.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


def timed_out(seconds: float) -> APIError:
    """504: the request (queue wait included) did not finish within the per-request timeout."""
    return APIError(
        504,
        f"The request did not finish within the server's per-request timeout ({seconds:g}s).",
        type="timeout_error",
        code="request_timeout",
    )


def shutting_down() -> APIError:
    """503: the server shut down before the answer was done (its grace period ran out)."""
    return APIError(
        503,
        "The server is shutting down and ended this answer before it was done; retry on another instance.",
        type="server_error",
        code="server_shutting_down",
    )


def internal_error(message: str = "The server had an error while processing your request.") -> APIError:
    """500 ``server_error``."""
    return APIError(500, message, type="server_error", code="internal_error")
