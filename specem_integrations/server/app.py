"""The ASGI application behind ``specem serve``: an OpenAI-compatible chat-completions server.

Starlette (routes, SSE) and uvicorn (the ASGI server; graceful shutdown on SIGINT / SIGTERM,
bounded by ``timeout_graceful_shutdown``), both in the ``server`` extra: the wire format is held
exactly, with OpenAI-style error bodies for every failure and requests validated by pydantic.

Concurrency model (one :class:`~specem_core.SpecEM` shared by every request, each request with
its own member sessions):

* **Admission**: at most ``max_concurrency`` requests run the ensemble at once; up to ``queue``
  more wait in FIFO order; beyond that the answer is 429 with ``Retry-After``.
* **Work**: each admitted request iterates ``engine.astream``, which runs the SpecEM loop in a
  worker thread; the event loop only moves segments to clients, so ``/health`` and new requests
  are answered while the ensemble computes.
* **Cancel**: the ASGI receive channel is watched for ``http.disconnect`` while a request waits
  in the queue, while it computes and while it streams; a client that goes away cancels the
  request: ``astream`` is closed, the engine stops after the round in progress and closes the
  member sessions (``/health`` counts open sessions through a thin wrapper on each member).
* **Timeout**: ``request_timeout`` seconds from arrival, queue wait included: 504
  ``request_timeout`` before the stream starts, an OpenAI-style ``error`` event inside a stream
  that has started.

Operations: every response carries ``X-Request-ID`` (the client's when valid, else a new one),
which every log line of the request and every error body carry too; ``GET /metrics`` exposes
Prometheus metrics (:mod:`specem_integrations.server._metrics`); ``GET /health/live`` answers
while the process serves HTTP, ``GET /health/ready`` once the members are probed and until
shutdown begins (:mod:`specem_integrations.server._readiness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from specem_core.backends.base import BatchingMember
from specem_core.engine import SpecEM
from specem_core.errors import AllMembersFailedError, ConfigError, ContextWindowError, InputError, SpecEMError
from specem_core.types import GenerationResult, StreamEvent
from specem_integrations.server._admission import Admission, QueueFullError, Stats
from specem_integrations.server._errors import (
    APIError,
    internal_error,
    invalid_request,
    model_not_found,
    queue_full,
    shutting_down,
    timed_out,
    unauthorized,
)
from specem_integrations.server._metrics import LiveState, ServerMetrics
from specem_integrations.server._playground import playground_routes
from specem_integrations.server._protocol import (
    TRACE_HEADER,
    ChunkWriter,
    EngineCall,
    build_call,
    completion_body,
    error_event,
    parse_request,
    sse,
)
from specem_integrations.server._readiness import Readiness
from specem_integrations.server._request_ids import (
    REQUEST_ID_HEADER,
    RequestIdMiddleware,
    current_request_id,
    new_request_id,
    request_id_of,
)
from specem_integrations.server._sessions import CountedMember, SessionCounter

T = TypeVar("T")

logger = logging.getLogger("specem.server")

DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_QUEUE = 64
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_WORKER_THREAD = "specem-astream"
"""Name of the engine's ``astream`` worker threads (counted by ``/health``)."""

Outcome = Literal["completed", "cancelled", "timed_out", "failed", "invalid"]
"""How a request ended (the name of the ``/health`` counter it adds to)."""


class _ClientGoneError(Exception):
    """The client closed the connection."""


class _TimedOutError(Exception):
    """The per-request deadline passed."""


class _DisconnectWatch:
    """Waits on the ASGI receive channel for ``http.disconnect`` (the body has been read already)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching (idempotent)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    async def stop(self) -> None:
        """Stop watching."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class _ShuttingDownError(Exception):
    """The server's shutdown grace period ran out before the answer was done."""


async def _guarded(
    work: Awaitable[T], watch: _DisconnectWatch, deadline: float | None, stop: asyncio.Event | None = None
) -> T:
    """Await ``work`` unless the client goes away, the deadline passes or ``stop`` is set first;
    then ``work`` is cancelled (and awaited, so that what it held is released) and the reason raised."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(watch.gone.wait())
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        waits = {task, gone} if stopped is None else {task, gone, stopped}
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        reason: Exception = (
            _ClientGoneError() if gone in done else _ShuttingDownError() if stopped in done else _TimedOutError()
        )
        raise reason
    finally:
        gone.cancel()
        if stopped is not None:
            stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass
class _Job:
    """One admitted (or waiting) chat-completion request."""

    call: EngineCall
    request_id: str
    """The ``X-Request-ID`` (in the logs and error bodies)."""
    completion_id: str
    """The answer's ``id`` (``chatcmpl-…``)."""
    created: int
    arrived: float
    """Event-loop time of arrival (the timeout, the queue wait and the latencies count from it)."""
    deadline: float | None
    agen: AsyncIterator[StreamEvent] | None = None
    admitted_at: float | None = None
    first_segment_at: float | None = None
    result: GenerationResult | None = None
    outcome: Outcome = "failed"
    finished: bool = False


class _EventStream(StreamingResponse):
    """An SSE response that stops as soon as the client goes away or the deadline passes."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        watch: _DisconnectWatch,
        deadline: float | None,
        on_timeout: Callable[[], bytes],
        finish: Callable[[Outcome | None], Awaitable[None]],
        headers: dict[str, str],
        stop: asyncio.Event | None = None,
        on_stop: Callable[[], bytes] = lambda: error_event(shutting_down()),
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._watch = watch
        self._deadline = deadline
        self._on_timeout = on_timeout
        self._on_stop = on_stop
        self._finish = finish
        self._stop = stop

    async def _pump(self, send: Send) -> None:
        async for chunk in self.body_iterator:
            data = chunk if isinstance(chunk, bytes) else str(chunk).encode()
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: Outcome | None = None  # None: as the body generator recorded it
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await _guarded(self._pump(send), self._watch, self._deadline, self._stop)
        except (_ClientGoneError, OSError):
            outcome = "cancelled"
        except _ShuttingDownError:  # the answer ends with an error event, then [DONE]
            outcome = "cancelled"
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": self._on_stop(), "more_body": True})
                await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _TimedOutError:
            outcome = "timed_out"
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": self._on_timeout(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:  # server shutdown past its grace period
            outcome = "cancelled"
            raise
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with contextlib.suppress(BaseException):
                    await closer()
            await self._finish(outcome)


class _Server:
    """State shared by the routes of one app (the API key is kept out of ``repr``)."""

    def __init__(
        self,
        engine: SpecEM,
        *,
        api_key: str | None,
        max_concurrency: int,
        queue: int,
        request_timeout: float | None,
        model_name: str,
        count_sessions: bool,
        max_body_bytes: int,
        metrics_public: bool = False,
    ) -> None:
        if not model_name or not model_name.strip():
            raise ValueError("model_name must be a non-empty string")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be non-empty (or None for no authentication)")
        self.sessions = SessionCounter()
        if count_sessions:
            members = [CountedMember(m, self.sessions) for m in engine.members]
            engine = SpecEM(members, engine.config, weights=engine.weights)  # the member weights too
        self.engine = engine
        self.member_names = [m.name for m in engine.members]
        self._key = api_key.encode() if api_key is not None else None
        self.admission = Admission(max_concurrency, queue)
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.model_name = model_name
        self.count_sessions = count_sessions
        self.max_body_bytes = max_body_bytes
        self.stats = Stats()
        self.metrics_public = metrics_public
        self.readiness = Readiness(engine.members)
        self.metrics = ServerMetrics(self.live_state, model_name, self.member_names)
        self.started = time.time()
        self.stopping = asyncio.Event()
        """Set when the shutdown grace period runs out: answers in flight end with an error."""
        self._loop: asyncio.AbstractEventLoop | None = None

    def end_answers_after(self, seconds: float) -> None:
        """End the answers still in flight ``seconds`` from now (thread- and signal-safe): a stream
        gets a ``server_shutting_down`` error event and ``[DONE]``, a JSON request a 503."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, max(0.0, seconds), self.stopping.set)

    def begin_draining(self) -> None:
        """Shutdown has begun (thread- and signal-safe): ``/health/ready`` answers 503 from now on."""
        self.readiness.begin_draining()

    def wait_idle(self, timeout: float) -> bool:
        """After the shutdown: wait (at most ``timeout`` seconds) until the request threads of the
        *served* engine have stopped and the members' background work is done. The served engine
        wraps the members to count sessions (``count_sessions``), so it is not the engine given to
        :func:`create_app`, whose ``wait_idle`` would find no thread to join. Returns whether all
        of it ended."""
        return self.engine.wait_idle(timeout)

    def __repr__(self) -> str:
        auth = "on" if self._key is not None else "off"
        return f"<specem server model={self.model_name!r} members={self.member_names} auth={auth}>"

    # -- helpers -------------------------------------------------------------------------------
    def count(self, outcome: Outcome | Literal["rejected"]) -> None:
        """A request ended: the ``/health`` counter and the ``specem_requests_total`` series."""
        self.stats.add(outcome)
        self.metrics.count(outcome)

    def authorize(self, request: Request, *, received: bool = False, counted: bool = True) -> None:
        """Check the bearer key (constant-time); nothing about the key given is echoed or logged.
        A refusal counts as ``invalid`` (and as ``received`` unless the caller counted it already;
        not at all with ``counted=False``: a scrape of ``/metrics`` is no request)."""
        if self._key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        missing = scheme.lower() != "bearer" or not token
        if missing or not hmac.compare_digest(token.encode(), self._key):
            if counted:
                if not received:
                    self.stats.add("received")
                self.count("invalid")
            raise unauthorized(missing=missing)

    async def read_json(self, request: Request) -> object:
        """The body as JSON (400 when it does not parse, 413 when it is too large)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise invalid_request("the request body is empty: send a JSON object", code="invalid_json")
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise invalid_request(
                f"We could not parse the JSON body of your request ({type(exc).__name__}: {exc}).",
                code="invalid_json",
            ) from None

    def engine_error(self, exc: BaseException, request_id: str) -> APIError:
        """An engine exception as an API error (4xx for the caller's input, 5xx otherwise)."""
        if isinstance(exc, ContextWindowError):
            return APIError(400, str(exc), param="messages", code="context_length_exceeded")
        if isinstance(exc, InputError | ConfigError):
            return invalid_request(str(exc))
        if isinstance(exc, AllMembersFailedError):  # one line naming each member, stage and error
            self.metrics.excluded(exc.excluded)
            logger.warning("request %s: %s", request_id, exc)
            return APIError(500, str(exc), type="server_error", code="all_members_failed")
        if isinstance(exc, SpecEMError):
            logger.warning("request %s: %s", request_id, exc)
            return APIError(500, str(exc), type="server_error", code="engine_error")
        logger.error("request %s failed", request_id, exc_info=(type(exc), exc, exc.__traceback__))
        return internal_error(f"The server had an error while processing your request (request id {request_id}).")

    def engine_workers(self) -> int:
        """Engine worker threads alive (a cancelled request's worker ends after its current round)."""
        return sum(1 for t in threading.enumerate() if t.name == _WORKER_THREAD)

    # -- request life cycle ----------------------------------------------------------------------
    async def admit(self, job: _Job) -> None:
        """Wait for a slot (raises :class:`QueueFullError`)."""
        await self.admission.acquire()
        job.admitted_at = asyncio.get_running_loop().time()
        self.stats.add("started")
        self.metrics.queued(job.admitted_at - job.arrived)

    def first_segment(self, job: _Job) -> None:
        """The request's first segment is here (counted once)."""
        if job.first_segment_at is None:
            job.first_segment_at = asyncio.get_running_loop().time()
            self.metrics.first_segment(job.first_segment_at - job.arrived)

    def stream_error(self, job: _Job, error: APIError) -> bytes:
        """An error event for a stream that has started, with the request id, counted by its code."""
        error.request_id = job.request_id
        self.metrics.error(error.code)
        return error_event(error)

    def start(self, job: _Job) -> AsyncIterator[StreamEvent]:
        """Start the engine on an admitted job."""
        call = job.call
        job.agen = self.engine.astream(call.messages, **call.kwargs, **call.overrides)
        return job.agen

    async def finish(self, job: _Job, outcome: Outcome | None = None) -> None:
        """Close the engine stream (the worker stops after its round), free the slot, count (once)."""
        if job.finished:
            return
        job.finished = True
        if outcome is not None:
            job.outcome = outcome
        closer = getattr(job.agen, "aclose", None)
        if closer is not None:
            with contextlib.suppress(BaseException):
                await closer()
        now = asyncio.get_running_loop().time()
        if job.admitted_at is not None:
            self.admission.release(now - job.admitted_at)
        self.count(job.outcome)
        if job.outcome == "completed" and job.result is not None:
            self.metrics.completed(job.result, now - job.arrived)
        self.log_finished(job, now)

    def log_finished(self, job: _Job, now: float) -> None:
        """One line per request that reached the queue: how it ended, its timings and tokens
        (as fields in JSON logs)."""
        result = job.result if job.outcome == "completed" else None
        fields: dict[str, Any] = {
            "outcome": job.outcome,
            "completion_id": job.completion_id,
            "stream": job.call.stream,
            "seconds": round(now - job.arrived, 3),
            "queue_seconds": None if job.admitted_at is None else round(job.admitted_at - job.arrived, 3),
            "first_segment_seconds": (
                None if job.first_segment_at is None else round(job.first_segment_at - job.arrived, 3)
            ),
        }
        if result is not None:
            fields.update(
                finish_reason=result.finish_reason,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                cached_tokens=result.usage.cached_tokens,
                rounds=len(result.segments),
                wins=result.wins,
                excluded=[f"{e.member}:{e.stage}" for e in result.excluded],
            )
        rounds = len(result.segments) if result else 0
        tokens = f", {result.usage.completion_tokens} tokens in {rounds} round{'s' * (rounds != 1)}" if result else ""
        logger.info(
            "chat completion %s after %.2fs (%s%s)",
            job.outcome,
            now - job.arrived,
            "stream" if job.call.stream else "json",
            tokens,
            extra=fields,
        )

    async def collect(self, job: _Job, agen: AsyncIterator[StreamEvent]) -> GenerationResult:
        """Run a request to its end."""
        async for event in agen:
            self.first_segment(job)
            if event.done and event.result is not None:
                job.result = event.result
                return event.result
        raise SpecEMError("the engine ended without a result")

    async def sse_body(self, job: _Job, first: StreamEvent) -> AsyncIterator[bytes]:
        """The SSE events of one streamed answer: role, one chunk per segment, calls, end, usage."""
        assert job.agen is not None
        call = job.call
        writer = ChunkWriter(job.completion_id, job.created, self.model_name, call.include_usage)
        yield sse(writer.chunk({"role": "assistant", "content": ""}))
        event = first
        while True:
            extra = {"specem": event.segment.to_dict()} if call.trace and event.segment is not None else None
            if event.delta:
                yield sse(writer.chunk({"content": event.delta}, extra=extra))
            if event.done:
                result = event.result
                if result is None:
                    job.outcome = "failed"
                    yield self.stream_error(job, internal_error("the engine ended without a result"))
                    return
                job.result = result
                for chunk in writer.tool_call_chunks(result):
                    yield sse(chunk)
                final_extra = {"specem": result.trace()} if call.trace else None
                yield sse(writer.chunk({}, result.finish_reason, extra=final_extra))
                if call.include_usage:
                    yield sse(writer.usage_chunk(result))
                yield sse("[DONE]")
                job.outcome = "completed"
                return
            try:
                event = await anext(job.agen)
            except StopAsyncIteration:
                job.outcome = "failed"
                yield self.stream_error(job, internal_error("the engine ended without a result"))
                return
            except Exception as exc:
                job.outcome = "failed"
                yield self.stream_error(job, self.engine_error(exc, job.request_id))
                return

    # -- routes --------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """Liveness plus load: requests running and queued, sessions and engine workers alive,
        readiness (always 200 while the process serves HTTP: probes use ``/health/live`` and
        ``/health/ready``)."""
        return JSONResponse(
            {
                "status": "ok",
                "ready": self.readiness.ready,
                "draining": self.readiness.draining,
                "model": self.model_name,
                "members": self.member_names,
                "max_concurrency": self.admission.max_concurrency,
                "queue": self.admission.queue,
                "requests_in_flight": self.admission.running,
                "requests_queued": self.admission.waiting,
                "sessions_open": self.sessions.open if self.count_sessions else None,
                "sessions_opened_total": self.sessions.opened_total if self.count_sessions else None,
                "engine_workers": self.engine_workers(),
                "decode_batching": self.decode_batching(),
                "requests": self.stats.to_dict(),
                "uptime_s": round(time.time() - self.started, 3),
            }
        )

    async def live(self, request: Request) -> Response:
        """``GET /health/live``: 200 while the process answers HTTP (restart it when this fails)."""
        return JSONResponse({"status": "alive"})

    async def ready(self, request: Request) -> Response:
        """``GET /health/ready``: 200 once the members are loaded and probed, 503 before that and
        from the start of shutdown (send no new traffic); the members' probe results either way."""
        state = self.readiness.state()
        body = {"status": state, "ready": state == "ready", "members": self.readiness.members()}
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    def live_state(self) -> LiveState:
        """What the metrics' gauges show now."""
        breakers = []
        for member in self.engine.members:
            breaker = getattr(getattr(member, "client", None), "breaker", None)
            if breaker is not None and hasattr(breaker, "state"):
                breakers.append((member.name, breaker))
        weights = self.engine.weights
        return LiveState(
            running=self.admission.running,
            queued=self.admission.waiting,
            max_concurrency=self.admission.max_concurrency,
            queue=self.admission.queue,
            sessions_open=self.sessions.open if self.count_sessions else None,
            engine_workers=self.engine_workers(),
            ready=self.readiness.ready,
            draining=self.readiness.draining,
            breakers=breakers,
            weights=weights.current() if weights is not None else {},
        )

    async def metrics_page(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text (OpenMetrics when the scraper asks for it). Needs the
        API key when the server has one, unless ``metrics_public``."""
        if not self.metrics_public:
            self.authorize(request, counted=False)
        body, content_type = self.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    def decode_batching(self) -> dict[str, dict[str, Any]]:
        """Per device queue (transformers members batching across requests): passes that served
        decode steps, the steps, how many shared a pass on average and at most; verification
        passes and the blocks they served; prefill passes and the prompts they served; other
        passes (rollbacks, multi-token feeds); device seconds in each kind."""
        out: dict[str, dict[str, Any]] = {}
        for member in self.engine.members:
            stats = member.batch_stats if isinstance(member, BatchingMember) else None
            if stats is not None and f"torch:{stats.device}" not in out:
                out[f"torch:{stats.device}"] = {
                    "passes": stats.passes,
                    "decode_steps": stats.steps,
                    "rows_per_pass": round(stats.rows_per_pass, 3),
                    "largest": stats.largest,
                    "score_passes": stats.score_passes,
                    "score_blocks": stats.score_blocks,
                    "prefill_passes": stats.prefill_passes,
                    "prefills": stats.prefills,
                    "other_passes": stats.exclusive,
                    "decode_seconds": round(stats.decode_s, 3),
                    "score_seconds": round(stats.score_s, 3),
                    "prefill_seconds": round(stats.prefill_s, 3),
                    "other_seconds": round(stats.exclusive_s, 3),
                }
        return out

    def _model(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "specem",
            "members": self.member_names,
        }

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the ensemble as one model."""
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}``."""
        self.authorize(request)
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise model_not_found(model_id)
        return JSONResponse(self._model())

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` (JSON or SSE)."""
        self.stats.add("received")
        self.authorize(request, received=True)
        try:
            try:
                body = await self.read_json(request)
            except ClientDisconnect:  # gone while sending the body
                self.count("cancelled")
                return Response(status_code=499)
            req = parse_request(body)
            if req.model is not None and req.model != self.model_name:
                raise model_not_found(req.model)
            trace_header = request.headers.get(TRACE_HEADER, "").strip().lower() in ("1", "true", "yes")
            call = build_call(
                req, self.engine.config, trace_header=trace_header, members=[m.name for m in self.engine.members]
            )
        except APIError:
            self.count("invalid")
            raise
        loop = asyncio.get_running_loop()
        self._loop = loop
        now = loop.time()
        request_id = current_request_id.get() or new_request_id()
        # the answer's id: the request id's when the server made that one, else a fresh one (a
        # client's X-Request-ID may repeat; completion ids should not)
        generated = request.headers.get(REQUEST_ID_HEADER, "").strip() != request_id
        job = _Job(
            call=call,
            request_id=request_id,
            completion_id=f"chatcmpl-{request_id if generated else new_request_id()}",
            created=int(time.time()),
            arrived=now,
            deadline=None if self.request_timeout is None else now + self.request_timeout,
        )
        watch = _DisconnectWatch(request.receive)
        watch.start()
        handed_over = False
        try:
            try:
                await _guarded(self.admit(job), watch, job.deadline)
            except QueueFullError as exc:
                self.count("rejected")
                job.finished = True
                raise queue_full(exc.retry_after) from None
            agen = self.start(job)
            if call.stream:
                first = await _guarded(anext(agen), watch, job.deadline)
                self.first_segment(job)
                seconds = self.request_timeout or 0.0

                async def finish(outcome: Outcome | None) -> None:
                    await self.finish(job, outcome)
                    await watch.stop()

                response = _EventStream(
                    self.sse_body(job, first),
                    watch,
                    job.deadline,
                    on_timeout=lambda: self.stream_error(job, timed_out(seconds)),
                    finish=finish,
                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                    stop=self.stopping,
                    on_stop=lambda: self.stream_error(job, shutting_down()),
                )
                handed_over = True
                return response
            result = await _guarded(self.collect(job, agen), watch, job.deadline, self.stopping)
            job.outcome = "completed"
            body_out = completion_body(
                result, request_id=job.completion_id, created=job.created, model=self.model_name, trace=call.trace
            )
            return JSONResponse(body_out)
        except _ClientGoneError:
            job.outcome = "cancelled"
            return Response(status_code=499)  # nobody is listening any more
        except _TimedOutError:
            job.outcome = "timed_out"
            raise timed_out(self.request_timeout or 0.0) from None
        except _ShuttingDownError:
            job.outcome = "cancelled"
            raise shutting_down() from None
        except APIError:
            raise
        except Exception as exc:
            job.outcome = "failed"
            error = self.engine_error(exc, job.request_id)
            if error.status < 500:
                job.outcome = "invalid"  # the caller's input (e.g. context_length_exceeded)
            raise error from None
        finally:
            if not handed_over:
                await self.finish(job)
                await watch.stop()


def _answer(request: Request, error: APIError) -> Response:
    """An error response with the request id in its body, counted by its code."""
    error.request_id = request_id_of(request.scope)
    server = getattr(request.app.state, "specem", None)
    if isinstance(server, _Server):
        server.metrics.error(error.code)
    return error.response()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _answer(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = APIError(exc.status_code, message, type=kind, code=codes.get(exc.status_code), headers=exc.headers)
    return _answer(request, error)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Starlette answers this outside the middleware: the request id is put back for the log line
    # and the response header here
    request_id = request_id_of(request.scope)
    token = current_request_id.set(request_id)
    try:
        logger.error(
            "unhandled error on %s %s", request.method, request.url.path, exc_info=(type(exc), exc, exc.__traceback__)
        )
    finally:
        current_request_id.reset(token)
    response = _answer(request, internal_error())
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


def create_app(
    engine: SpecEM,
    *,
    api_key: str | None = None,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    queue: int = DEFAULT_QUEUE,
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
    model_name: str = "specem",
    count_sessions: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ui: bool = False,
    metrics_public: bool = False,
) -> Starlette:
    """The OpenAI-compatible ASGI app serving ``engine`` as one model.

    Routes: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``,
    ``GET /v1/models/{id}``; ``GET /health`` (load and counters), ``GET /health/live`` and
    ``GET /health/ready`` (probes), all three without authentication; ``GET /metrics``
    (Prometheus). Every response carries ``X-Request-ID``: the client's when it is 1-128
    characters of letters, digits and ``._:/+=@~-``, else a new one; every log line written for
    the request and every error body (``"request_id"`` beside ``"error"``) carry it too.

    Args:
        engine: the ensemble; every request shares its loaded members and its configuration
            (the defaults that a request's parameters override).
        api_key: when given, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (compared in
            constant time; never logged or echoed).
        max_concurrency: requests running the ensemble at once.
        queue: requests allowed to wait for a slot; beyond that 429 with ``Retry-After``.
        request_timeout: seconds from arrival (queue wait included); ``None`` or 0: no limit.
        model_name: the model id clients name (``GET /v1/models``); another name is a 404.
        count_sessions: wrap each member to count open sessions for ``/health`` (the members'
            weights stay shared; the served engine is ``SpecEM(wrapped members, engine.config,
            weights=engine.weights)``).
        max_body_bytes: larger request bodies are refused with 413.
        ui: serve the browser playground on ``GET /`` (one page and its assets under
            ``/playground/``, package data; it uses only the public endpoints). Off: ``/`` is 404.
        metrics_public: serve ``GET /metrics`` without the API key (by default it needs the key
            whenever ``api_key`` is set; without a key it is open like every route).

    Raises:
        ValueError: a bad limit, an empty ``model_name`` or an empty ``api_key``.
    """
    server = _Server(
        engine,
        api_key=api_key,
        max_concurrency=max_concurrency,
        queue=queue,
        request_timeout=request_timeout,
        model_name=model_name,
        count_sessions=count_sessions,
        max_body_bytes=max_body_bytes,
        metrics_public=metrics_public,
    )
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/health/live", server.live, methods=["GET"]),
        Route("/health/ready", server.ready, methods=["GET"]),
        Route("/metrics", server.metrics_page, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    if ui:
        routes += playground_routes()
    app = Starlette(
        routes=routes,
        middleware=[Middleware(RequestIdMiddleware)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    app.state.specem = server
    server.readiness.start()  # probe the members reached over HTTP, in the background
    return app
