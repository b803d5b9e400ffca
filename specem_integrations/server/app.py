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
  member sessions (``/health`` counts open sessions through an observer registered on the
  engine: :mod:`specem_core.observers`).
* **Timeout**: ``request_timeout`` seconds from arrival, queue wait included: 504
  ``request_timeout`` before the stream starts, an OpenAI-style ``error`` event inside a stream
  that has started.

Operations: every response carries ``X-Request-ID`` (the client's when valid, else a new one),
which every log line of the request and every error body carry too; ``GET /metrics`` exposes
Prometheus metrics (:mod:`specem_integrations.server._metrics`); ``GET /health/live`` answers
while the process serves HTTP, ``GET /health/ready`` once the members are probed and until
shutdown begins (:mod:`specem_integrations.server._readiness`).

The parts, by concern: authentication (:mod:`~specem_integrations.server._auth`), readiness and
shutdown (:mod:`~specem_integrations.server._lifecycle`), the live state behind ``/health`` and the
gauges (:mod:`~specem_integrations.server._live`), one request's run
(:mod:`~specem_integrations.server._requests`, :mod:`~specem_integrations.server._stream`); this
module wires them into routes.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specem_core.engine import SpecEM
from specem_integrations.server._admission import Admission, Stats
from specem_integrations.server._auth import BearerAuth
from specem_integrations.server._errors import APIError, internal_error, model_not_found
from specem_integrations.server._lifecycle import Lifecycle
from specem_integrations.server._live import LiveView
from specem_integrations.server._metrics import ServerMetrics
from specem_integrations.server._playground import playground_routes
from specem_integrations.server._protocol import TRACE_HEADER, build_call, parse_request
from specem_integrations.server._request_ids import (
    REQUEST_ID_HEADER,
    RequestIdMiddleware,
    current_request_id,
    request_id_of,
)
from specem_integrations.server._requests import RequestRunner, read_json
from specem_integrations.server._sessions import SessionCounter

logger = logging.getLogger("specem.server")

DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_QUEUE = 64
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class _Server:
    """The routes of one app over its parts (the API key is kept out of ``repr``): authentication,
    readiness and shutdown, the live state, the request runner."""

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
        self.auth = BearerAuth(api_key)
        self.admission = Admission(max_concurrency, queue)
        self.engine = engine
        self.member_names = [m.name for m in engine.members]
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.metrics_public = metrics_public
        self.stats = Stats()
        self.sessions = SessionCounter() if count_sessions else None
        if self.sessions is not None:
            engine.add_observer(self.sessions)  # the engine tells it of every session opened and closed
        self.lifecycle = Lifecycle(engine, engine.members)
        self.live = LiveView(engine, self.admission, self.lifecycle.readiness, self.stats, self.sessions)
        self.metrics = ServerMetrics(self.live.state, model_name, self.member_names)
        timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.runner = RequestRunner(
            engine, self.admission, self.stats, self.metrics, self.lifecycle, model_name, timeout
        )

    # -- what run_server calls (thread- and signal-safe) -----------------------------------------
    def end_answers_after(self, seconds: float) -> None:
        """End the answers still in flight ``seconds`` from now: a stream gets a
        ``server_shutting_down`` error event and ``[DONE]``, a JSON request a 503."""
        self.lifecycle.end_answers_after(seconds)

    def begin_draining(self) -> None:
        """Shutdown has begun: ``/health/ready`` answers 503 from now on."""
        self.lifecycle.begin_draining()

    def wait_idle(self, timeout: float) -> bool:
        """After the shutdown: wait (at most ``timeout`` seconds) until the engine's request threads
        have stopped and the members' background work is done. Returns whether all of it ended."""
        return self.lifecycle.wait_idle(timeout)

    def __repr__(self) -> str:
        auth = "on" if self.auth.enabled else "off"
        return f"<specem server model={self.model_name!r} members={self.member_names} auth={auth}>"

    def authorize(self, request: Request, *, received: bool = False, counted: bool = True) -> None:
        """Check the bearer key; nothing about the key given is echoed or logged. A refusal counts
        as ``invalid`` (and as ``received`` unless the caller counted it already; not at all with
        ``counted=False``: a scrape of ``/metrics`` is no request)."""
        try:
            self.auth.check(request)
        except APIError:
            if counted:
                if not received:
                    self.stats.add("received")
                self.runner.count("invalid")
            raise

    # -- routes --------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """Liveness plus load: requests running and queued, sessions and engine workers alive,
        readiness (always 200 while the process serves HTTP: probes use ``/health/live`` and
        ``/health/ready``)."""
        return JSONResponse(self.live.health(self.model_name, self.member_names))

    async def alive(self, request: Request) -> Response:
        """``GET /health/live``: 200 while the process answers HTTP (restart it when this fails)."""
        return JSONResponse({"status": "alive"})

    async def ready(self, request: Request) -> Response:
        """``GET /health/ready``: 200 once the members are loaded and probed, 503 before that and
        from the start of shutdown (send no new traffic); the members' probe results either way."""
        readiness = self.lifecycle.readiness
        state = readiness.state()
        body = {"status": state, "ready": state == "ready", "members": readiness.members()}
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    async def metrics_page(self, request: Request) -> Response:
        """``GET /metrics``: Prometheus text (OpenMetrics when the scraper asks for it). Needs the
        API key when the server has one, unless ``metrics_public``."""
        if not self.metrics_public:
            self.authorize(request, counted=False)
        body, content_type = self.metrics.render(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    def _model(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": int(self.live.started),
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
                body = await read_json(request, self.max_body_bytes)
            except ClientDisconnect:  # gone while sending the body
                self.runner.count("cancelled")
                return Response(status_code=499)
            req = parse_request(body)
            if req.model is not None and req.model != self.model_name:
                raise model_not_found(req.model)
            trace_header = request.headers.get(TRACE_HEADER, "").strip().lower() in ("1", "true", "yes")
            call = build_call(
                req, self.engine.config, trace_header=trace_header, members=[m.name for m in self.engine.members]
            )
        except APIError:
            self.runner.count("invalid")
            raise
        return await self.runner.run(request, call)


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
        count_sessions: count the open member sessions for ``/health`` and ``/metrics`` (an
            observer registered on ``engine``, :meth:`~specem_core.SpecEM.add_observer`; the
            engine itself is served, not a copy).
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
        Route("/health/live", server.alive, methods=["GET"]),
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
    server.lifecycle.readiness.start()  # probe the members reached over HTTP, in the background
    return app
