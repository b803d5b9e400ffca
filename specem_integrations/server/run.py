"""Run the app with uvicorn on a socket bound beforehand (used by ``specem serve``)."""

from __future__ import annotations

import logging
import math
import socket
import sys

from starlette.applications import Starlette

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


def run_server(
    app: Starlette,
    sock: socket.socket,
    *,
    graceful_timeout: float | None = 30.0,
    log_level: str = "info",
    access_log: bool = True,
) -> bool:
    """Serve ``app`` on ``sock`` until SIGINT / SIGTERM, then shut down gracefully.

    On a signal uvicorn stops accepting connections and lets requests in flight finish for up to
    ``graceful_timeout`` seconds; it then cancels them (the engine stops after the round in
    progress and closes the member sessions).

    Returns:
        False when the server could not start.
    """
    import uvicorn

    ours = logging.getLogger("specem.server")
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(log_level.upper())
        ours.propagate = False
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=math.ceil(graceful_timeout) if graceful_timeout else None,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return bool(server.started)
