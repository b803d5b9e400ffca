"""Run the app with uvicorn on a socket bound beforehand (used by ``specem serve``)."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from starlette.applications import Starlette

from specem_integrations.server._logging import LogFormat, log_config

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port=0`` picks a free one).

    ``specem serve`` binds before it loads the models, so that a busy port or a bad address
    fails at once rather than after a minute of loading.

    Raises:
        OSError: the address cannot be resolved or bound (the message names it).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


IDLE_AFTER_SHUTDOWN_SECONDS = 60.0
"""How long :func:`run_server` waits, after uvicorn stopped, for the request threads it ended."""

_END_MARGIN = 1.0
"""Seconds before uvicorn's own deadline at which answers still in flight are ended with an
error event, so that each stream closes cleanly rather than being cut off."""


def _server_class() -> Any:
    import uvicorn

    class _GracefulServer(uvicorn.Server):
        """uvicorn's server, telling the app when the shutdown grace period is about to run out."""

        def __init__(
            self, config: uvicorn.Config, end_answers_after: Any, grace: float | None, begin_draining: Any = None
        ) -> None:
            super().__init__(config)
            self._end_answers_after = end_answers_after
            self._grace = grace
            self._begin_draining = begin_draining

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            first = not self.should_exit
            if first and self._begin_draining is not None:
                self._begin_draining()  # /health/ready answers 503 from now on
            super().handle_exit(sig, frame)
            if first and self._grace is not None and self._end_answers_after is not None:
                self._end_answers_after(max(0.0, self._grace - min(_END_MARGIN, self._grace / 4)))

    return _GracefulServer


@contextlib.contextmanager
def _exit_signals_handled() -> Iterator[None]:
    """uvicorn re-raises the SIGINT / SIGTERM it shut down on once it is done; absorbed here, so
    that a completed graceful shutdown ends the process with status 0."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(
    app: Starlette,
    sock: socket.socket,
    *,
    graceful_timeout: float | None = 30.0,
    log_level: str = "info",
    access_log: bool = True,
    log_format: LogFormat = "text",
) -> bool:
    """Serve ``app`` on ``sock`` until SIGINT / SIGTERM, then shut down gracefully.

    On a signal uvicorn stops accepting connections and lets requests in flight finish for up to
    ``graceful_timeout`` seconds. Shortly before that (a second, or a quarter of a shorter grace
    period) the answers still running are ended: a stream gets a ``server_shutting_down`` error
    event and ``[DONE]``, a JSON request a 503 with that code; the engine stops after the round in
    progress and closes the member sessions. Before returning it waits (at most
    :data:`IDLE_AFTER_SHUTDOWN_SECONDS`) until those request threads have stopped and the members'
    background work is done, so that no thread is inside a native library (llama.cpp) when the
    process exits: a thread still decoding then crashed the process in llama.cpp's exit-time
    destructors (docs/guides/reliability.md, "A clean exit"). The process then exits normally
    (status 0). From the signal on, ``/health/ready`` answers 503.

    Logging (:func:`~specem_integrations.server._logging.log_config`): ``log_format`` ``text`` or
    ``json`` (one object per line), every line with its request's id.

    Returns:
        False when the server could not start.
    """
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=log_config(log_level, log_format),
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=math.ceil(graceful_timeout) if graceful_timeout else None,
        lifespan="off",
    )
    grace = float(config.timeout_graceful_shutdown) if config.timeout_graceful_shutdown else None
    specem = getattr(app.state, "specem", None)
    server = _server_class()(
        config, getattr(specem, "end_answers_after", None), grace, getattr(specem, "begin_draining", None)
    )
    with _exit_signals_handled():
        server.run(sockets=[sock])
    if specem is not None and not specem.wait_idle(IDLE_AFTER_SHUTDOWN_SECONDS):
        logging.getLogger("specem.server").warning(
            "request threads still running %.0fs after the shutdown", IDLE_AFTER_SHUTDOWN_SECONDS
        )
    return bool(server.started)
