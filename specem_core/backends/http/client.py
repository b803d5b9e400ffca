"""The transport of server members: one pooled, retrying, secret-safe ``httpx`` client per server.

``httpx`` with an async core on one background event loop (connection pooling across all
requests of a member), exposed through a synchronous facade (:func:`run_sync`) for the engine's
worker threads and through :func:`run_async` for async callers. Retries with exponential backoff
and jitter on 429 (``Retry-After`` honoured), 408, 5xx and connection errors / timeouts;
in-flight requests are cancelled through :class:`Inflight` (``session.cancel()``,
``session.close()``) and by asyncio task cancellation. A :class:`CircuitBreaker` per server
(:class:`BreakerPolicy`) stops sending to a server that keeps failing at the transport level, so
that while it is down requests fail at once instead of each paying connect attempts, retries and
backoff; after a cool-down one request probes it again. API keys and header values are held as
:class:`pydantic.SecretStr`: they never appear in ``repr``, log records or error messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import json
import logging
import random
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from specem_core.backends.http.errors import (
    HTTPMemberError,
    RequestCancelledError,
    ServerResponseError,
    ServerUnavailableError,
)

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


def event_loop() -> asyncio.AbstractEventLoop:
    """The members' event loop (one daemon thread; every member's ``AsyncClient`` lives there)."""
    return _Loop.get()


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
    """Retries after the first attempt (0: fail on the first retryable error)."""
    backoff_base: float = 0.5
    """First backoff in seconds; doubles per attempt, with ±50% jitter."""
    backoff_max: float = 20.0
    """The longest backoff in seconds, before jitter."""
    max_retry_after: float = 60.0
    """A longer ``Retry-After`` is not waited for: the request fails."""

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0-based)."""
        delay = min(self.backoff_max, self.backoff_base * (2**attempt))
        return float(delay * (0.5 + random.random()))


# -- circuit breaker ------------------------------------------------------------------------
@dataclass(frozen=True)
class BreakerPolicy:
    """When a server counts as down, and when it is tried again (:class:`CircuitBreaker`).

    * **closed** (normal): requests go through; ``failures_to_open`` transport failures in a row
      (connection refused or reset, connect / read timeouts, a connection closed mid-answer:
      ``httpx.TransportError``; HTTP error statuses do not count) open the breaker.
    * **open**: every request fails at once with
      :class:`~specem_core.backends.http.errors.ServerUnavailableError` (no connection attempt,
      no retry, no backoff), so the engine excludes the member from the request right away.
    * **half-open**: once ``cool_down`` seconds have passed, the next request is let through as a
      probe (one at a time; others still fail at once). If it gets an answer the breaker closes;
      if it fails the breaker opens again and the cool-down doubles, up to ``max_cool_down``.
    """

    failures_to_open: int = 3
    """Transport failures in a row that open the breaker (at least 1)."""
    cool_down: float = 5.0
    """Seconds before the first probe of a server found down."""
    max_cool_down: float = 30.0
    """The cool-down doubles after each failed probe, up to this."""
    enabled: bool = True
    """``False``: never open (every request is tried and retried as :class:`RetryPolicy` says)."""

    def __post_init__(self) -> None:
        if self.failures_to_open < 1:
            raise ValueError(f"failures_to_open must be at least 1, got {self.failures_to_open}")
        if not 0 <= self.cool_down <= self.max_cool_down:
            raise ValueError(
                f"need 0 <= cool_down <= max_cool_down, got cool_down={self.cool_down}, "
                f"max_cool_down={self.max_cool_down}"
            )


BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """The health of one server as its clients see it (see :class:`BreakerPolicy`); thread-safe.

    Shared by every :class:`OpenAIClient` of the same server URL and transport
    (:func:`breaker_for`), so members that use one server learn together that it is down.
    """

    def __init__(self, key: str, policy: BreakerPolicy | None = None, *, clock: Callable[[], float] = time.monotonic):
        self.key = key
        self.policy = policy or BreakerPolicy()
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._cool_down = self.policy.cool_down
        self._probing = False
        self.last_error = ""
        self.opened = 0
        """Times the breaker opened (a failed probe counts again)."""
        self.rejected = 0
        """Requests refused at once while open."""

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.key!r}, state={self.state!r}, failures={self._failures})"

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state()

    def _state(self) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        if self._probing or self._clock() - self._opened_at < self._cool_down:
            return "open"
        return "half_open"

    def before_request(self) -> bool:
        """Admit a request attempt (``True`` when it is the half-open probe).

        Raises:
            ServerUnavailableError: the breaker is open (or another request is probing).
        """
        if not self.policy.enabled:
            return False
        with self._lock:
            state = self._state()
            if state == "closed":
                return False
            if state == "half_open":
                self._probing = True
                return True
            self.rejected += 1
            assert self._opened_at is not None
            left = max(0.0, self._cool_down - (self._clock() - self._opened_at))
            when = "a probe is in flight" if self._probing else f"next probe in {left:.1f}s"
            raise ServerUnavailableError(
                f"circuit open for {self.key}: {self._failures} transport failures in a row, "
                f"last: {self.last_error or 'unknown'}; not contacted ({when})"
            )

    def record_success(self) -> None:
        """The server answered (any HTTP status): close the breaker."""
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probing = False
            self._cool_down = self.policy.cool_down

    def release_probe(self) -> None:
        """The probe was cancelled before an answer: the next request probes instead."""
        with self._lock:
            self._probing = False

    def record_failure(self, error: str, *, probe: bool) -> None:
        """A transport failure: count it; open (or re-open, after a failed probe) when due."""
        if not self.policy.enabled:
            return
        with self._lock:
            self._failures += 1
            self.last_error = error
            if probe or self._probing:
                self._probing = False
                self._cool_down = min(self.policy.max_cool_down, max(self._cool_down * 2, 1e-3))
                self._opened_at = self._clock()
                self.opened += 1
                log.warning("%s: probe failed; circuit open again for %.1fs (%s)", self.key, self._cool_down, error)
            elif self._opened_at is None and self._failures >= self.policy.failures_to_open:
                self._opened_at = self._clock()
                self.opened += 1
                log.warning(
                    "%s: %d transport failures in a row; circuit open for %.1fs (%s)",
                    self.key,
                    self._failures,
                    self._cool_down,
                    error,
                )


_breakers: dict[str, CircuitBreaker] = {}
"""Breakers of the servers reached over the network, by origin."""
_breakers_by_transport: weakref.WeakKeyDictionary[httpx.AsyncBaseTransport, dict[str, CircuitBreaker]] = (
    weakref.WeakKeyDictionary()
)
"""Breakers of custom transports (tests' mock servers), forgotten with their transport."""
_breakers_lock = threading.Lock()


def breaker_for(
    base_url: str, policy: BreakerPolicy | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> CircuitBreaker:
    """The breaker shared by the clients of ``base_url``'s server (scheme, host and port) over
    ``transport`` (the network by default; a test's mock transport gets its own). The first
    caller's policy is kept; a later caller passing another policy replaces it."""
    parts = urlsplit(base_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    with _breakers_lock:
        table = _breakers if transport is None else _breakers_by_transport.setdefault(transport, {})
        breaker = table.get(origin)
        if breaker is None:
            breaker = table[origin] = CircuitBreaker(origin, policy)
        elif policy is not None and policy != breaker.policy:
            breaker.policy = policy
        return breaker


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
        breaker: the :class:`BreakerPolicy` of this server's :class:`CircuitBreaker` (shared with
            the other clients of the same server; default ``BreakerPolicy()``).
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
        breaker: BreakerPolicy | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.breaker = breaker_for(self.base_url, breaker, transport)
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
        events: bool = False,
    ) -> Any:
        """Send a request and return the decoded JSON body, retrying per the policy.

        ``url`` may also be absolute (the tokenizer endpoints beside ``/v1``). With ``events`` the
        answer is a stream of server-sent events (``"stream": true``): it is read whole and the
        ``data:`` objects are returned as a list (``[DONE]`` dropped).

        Raises:
            HTTPMemberError: a non-retryable status, or retries exhausted.
            ServerResponseError: a 2xx answer that is not valid JSON.
        """
        client = self._http()
        max_retries = self.retry.max_retries if retries is None else retries
        url = path if path.startswith(("/", "http://", "https://")) else f"/{path}"
        attempt = 0
        while True:
            probe = self.breaker.before_request()  # raises at once while the server is known down
            self.requests += 1
            wait: float | None = None
            try:
                kwargs: dict[str, Any] = {}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                response = await client.request(method, url, json=payload, **kwargs)
            except httpx.TransportError as exc:  # connection errors, timeouts, truncated bodies
                message = self.redact(f"{type(exc).__name__} on {method} {url}: {exc}".rstrip(": "))
                self.breaker.record_failure(message, probe=probe)
                if attempt >= max_retries:
                    raise HTTPMemberError(f"{message} (after {attempt + 1} attempts)") from None
                if self.breaker.state == "open":  # no backoff before an attempt that would be refused
                    raise ServerUnavailableError(f"{message} (circuit now open for {self.breaker.key})") from None
            except BaseException:  # cancelled: says nothing about the server
                if probe:
                    self.breaker.release_probe()
                raise
            else:
                self.breaker.record_success()
                if response.is_success:
                    try:
                        return server_events(response.text) if events else response.json()
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

    async def post(
        self, path: str, payload: Mapping[str, Any], *, timeout: float | None = None, events: bool = False
    ) -> Any:
        return await self.request_json("POST", path, payload, timeout=timeout, events=events)


def server_events(text: str) -> list[Any]:
    """The JSON objects of a server-sent event stream's ``data:`` lines (``[DONE]`` left out).

    Raises:
        ValueError: a ``data:`` line that is not JSON.
    """
    out: list[Any] = []
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data and data != "[DONE]":
            out.append(json.loads(data))
    return out


async def gather(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
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
