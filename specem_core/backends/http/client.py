"""The transport of server members: one pooled, retrying, secret-safe ``httpx`` client per server.

``httpx`` with an async core on one background event loop (connection pooling across all
requests of a member), exposed through a synchronous facade (:func:`run_sync`) for the engine's
worker threads and through :func:`run_async` for async callers. Retries with exponential backoff
and jitter on 429 (``Retry-After`` honoured), 408, 5xx and connection errors / timeouts;
in-flight requests are cancelled through :class:`Inflight` (``session.cancel()``,
``session.close()``) and by asyncio task cancellation. API keys and header values are held as
:class:`pydantic.SecretStr`: they never appear in ``repr``, log records or error messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import SecretStr

from specem_core.backends.http.errors import HTTPMemberError, RequestCancelledError, ServerResponseError

log = logging.getLogger("specem.http")

T = TypeVar("T")

_SENSITIVE_HEADERS = ("authorization", "proxy-authorization", "api-key", "x-api-key", "cookie")


# -- secrets --------------------------------------------------------------------------------
def _secret(value: str | SecretStr | None) -> SecretStr | None:
    if value is None:
        return None
    return value if isinstance(value, SecretStr) else SecretStr(str(value))


class _Redactor:
    """Replaces every secret value with ``***`` in text that may reach a user or a log."""

    def __init__(self, secrets: Sequence[SecretStr]) -> None:
        values = {s.get_secret_value() for s in secrets}
        # Also the bare token of "Bearer <key>"-style header values.
        values |= {v.split(None, 1)[1] for v in list(values) if " " in v.strip()}
        self._values = sorted((v for v in values if len(v) >= 4), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self._values:
            text = text.replace(value, "***")
        return text


# -- background event loop: async core, sync facade ----------------------------------------
class _Loop:
    """One daemon thread running an asyncio loop that owns every member's ``AsyncClient``."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                threading.Thread(target=run, name="specem-http-loop", daemon=True).start()
                ready.wait()
                cls._loop = loop
            return cls._loop


class Inflight:
    """The in-flight requests of a session, so that ``cancel()`` can stop them from any thread.

    A cancel that races with a request being submitted still reaches it (cancel epochs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: set[concurrent.futures.Future[Any]] = set()
        self._epoch = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def add(self, future: concurrent.futures.Future[Any], epoch: int) -> None:
        with self._lock:
            self._futures.add(future)
            if self._epoch != epoch:  # cancelled while it was being submitted
                future.cancel()

    def discard(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._futures.discard(future)

    def cancel(self) -> None:
        with self._lock:
            self._epoch += 1
            futures = list(self._futures)
        for future in futures:
            future.cancel()


def run_sync(coro: Coroutine[Any, Any, T], *, track: Inflight | None = None) -> T:
    """Run ``coro`` on the background loop and wait for it (from any thread but that loop's)."""
    loop = _Loop.get()
    epoch = track.epoch if track is not None else 0
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    if track is not None:
        track.add(future, epoch)
    try:
        return future.result()
    except concurrent.futures.CancelledError as exc:
        raise RequestCancelledError("request cancelled") from exc
    except BaseException:
        future.cancel()
        raise
    finally:
        if track is not None:
            track.discard(future)


async def run_async(coro: Coroutine[Any, Any, T], *, track: Inflight | None = None) -> T:
    """Await ``coro`` on the background loop from any event loop; cancelling the caller cancels it."""
    loop = _Loop.get()
    if asyncio.get_running_loop() is loop:
        return await coro
    epoch = track.epoch if track is not None else 0
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    if track is not None:
        track.add(future, epoch)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.cancel()
        task = asyncio.current_task()
        if task is not None and task.cancelling() == 0:  # cancelled by session.cancel(), not by the caller
            raise RequestCancelledError("request cancelled") from None
        raise
    finally:
        if track is not None:
            track.discard(future)


# -- the HTTP client ------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    """How failed requests are retried.

    Retried: 429 (after ``Retry-After`` when the server sends one, capped by ``max_retry_after``),
    408, 5xx other than 501/505, connection errors and timeouts. Other 4xx fail at once.
    """

    max_retries: int = 3
    backoff_base: float = 0.5
    """First backoff in seconds; doubles per attempt, with ±50% jitter."""
    backoff_max: float = 20.0
    max_retry_after: float = 60.0
    """A longer ``Retry-After`` is not waited for: the request fails."""

    def backoff(self, attempt: int) -> float:
        delay = min(self.backoff_max, self.backoff_base * (2**attempt))
        return float(delay * (0.5 + random.random()))


def _retryable_status(status: int) -> bool:
    return status in (408, 429) or (500 <= status < 600 and status not in (501, 505))


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class OpenAIClient:
    """Async client of one OpenAI-compatible server: pooled, retrying, secret-safe.

    Args:
        base_url: the API root, e.g. ``http://gpu-1:8000/v1``.
        api_key: sent as ``Authorization: Bearer <key>``; held as a secret.
        headers: extra headers (values are held as secrets too).
        timeout: seconds per request (or an ``httpx.Timeout``).
        retry: the :class:`RetryPolicy`.
        transport: an ``httpx.AsyncBaseTransport`` (tests use ``httpx.MockTransport``).
        max_connections: connection pool size.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | SecretStr | None = None,
        headers: Mapping[str, str | SecretStr] | None = None,
        timeout: float | httpx.Timeout = 120.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 32,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = _secret(api_key)
        self._headers: dict[str, SecretStr] = {k: s for k, v in (headers or {}).items() if (s := _secret(v))}
        self.timeout = (
            timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout, connect=min(10.0, timeout))
        )
        self.retry = retry or RetryPolicy()
        self._transport = transport
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._sleep = sleep or asyncio.sleep
        secrets = [s for s in (self._api_key, *self._headers.values()) if s is not None]
        self.redact = _Redactor(secrets)
        self._client: httpx.AsyncClient | None = None
        self.requests = 0
        """Requests sent (including retries)."""
        self.retries = 0

    def __repr__(self) -> str:
        return f"OpenAIClient(base_url={self.base_url!r}, api_key={'***' if self._api_key else None})"

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            headers = {k: v.get_secret_value() for k, v in self._headers.items()}
            if self._api_key is not None:
                headers["Authorization"] = f"Bearer {self._api_key.get_secret_value()}"
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=headers,
                timeout=self.timeout,
                limits=self._limits,
                transport=self._transport,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def request_json(
        self,
        method: str,
        path: str,
        payload: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send a request and return the decoded JSON body, retrying per the policy.

        Raises:
            HTTPMemberError: a non-retryable status, or retries exhausted.
            ServerResponseError: a 2xx answer that is not valid JSON.
        """
        client = self._http()
        max_retries = self.retry.max_retries if retries is None else retries
        url = path if path.startswith("/") else f"/{path}"
        attempt = 0
        while True:
            self.requests += 1
            wait: float | None = None
            try:
                kwargs: dict[str, Any] = {}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                response = await client.request(method, url, json=payload, **kwargs)
            except httpx.TransportError as exc:  # connection errors, timeouts, truncated bodies
                message = self.redact(f"{type(exc).__name__} on {method} {url}: {exc}".rstrip(": "))
                if attempt >= max_retries:
                    raise HTTPMemberError(f"{message} (after {attempt + 1} attempts)") from None
            else:
                if response.is_success:
                    try:
                        return response.json()
                    except ValueError as exc:
                        snippet = self.redact(response.text[:200])
                        raise ServerResponseError(
                            f"{method} {url}: malformed JSON in a {response.status_code} answer: {snippet!r}"
                        ) from exc
                status = response.status_code
                body = self.redact(response.text[:300].strip())
                message = f"{method} {url} -> HTTP {status}: {body}" if body else f"{method} {url} -> HTTP {status}"
                if not _retryable_status(status):
                    raise HTTPMemberError(message, status=status)
                if attempt >= max_retries:
                    raise HTTPMemberError(f"{message} (after {attempt + 1} attempts)", status=status)
                if status == 429 or status == 503:
                    wait = _retry_after(response)
                    if wait is not None and wait > self.retry.max_retry_after:
                        raise HTTPMemberError(
                            f"{message} (Retry-After {wait:.0f}s exceeds max_retry_after)", status=status
                        )
            delay = wait if wait is not None else self.retry.backoff(attempt)
            log.debug("retrying %s %s in %.2fs (attempt %d): %s", method, url, delay, attempt + 1, message)
            self.retries += 1
            attempt += 1
            await self._sleep(delay)

    async def post(self, path: str, payload: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        return await self.request_json("POST", path, payload, timeout=timeout)


async def _gather(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run coroutines concurrently; the first failure cancels the rest and is raised as is."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        raise
