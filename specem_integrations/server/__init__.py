"""SpecEM as an OpenAI-compatible HTTP server (``specem serve``; ``.venv/bin/pip install -e '.[server]'``
after ``scripts/install.sh``).

    from specem_core import SpecEM, load_member
    from specem_integrations.server import create_app

    app = create_app(SpecEM([load_member("smollm2")]), api_key=None, max_concurrency=4)
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: ``POST /v1/chat/completions`` (JSON and SSE streaming, tools, ``response_format``),
``GET /v1/models``, ``GET /health``. See :mod:`specem_integrations.server.app` for the design.

One module per concern:

* :mod:`.app` — the routes and ``create_app`` (the server serves the engine it is given);
* :mod:`.run` — binding the socket, uvicorn, signals and the shutdown grace period;
* :mod:`._protocol` — the OpenAI wire format: request validation (the ``specem`` object is
  generated from the options' one declaration), response bodies;
* :mod:`._requests` — running one request on the engine (JSON or stream), errors as API errors;
* :mod:`._stream` — the server-sent events stream, client disconnects;
* :mod:`._admission` — concurrency slots and the queue (429 beyond it);
* :mod:`._auth` — the bearer key (never in ``repr`` or logs);
* :mod:`._lifecycle` and :mod:`._readiness` — ready, draining, stopping; members probed at start;
* :mod:`._live` and :mod:`._metrics` — ``/health``'s body and the Prometheus metrics;
* :mod:`._sessions` — open sessions counted by an engine observer;
* :mod:`._errors`, :mod:`._logging`, :mod:`._request_ids` — OpenAI-style errors, log lines, request ids;
* :mod:`._playground` — the browser playground on ``GET /``.
"""

from __future__ import annotations

from specem_integrations.server._errors import APIError
from specem_integrations.server._protocol import SpecEMOptions
from specem_integrations.server.app import create_app
from specem_integrations.server.run import bind_socket, run_server

__all__ = ["APIError", "SpecEMOptions", "bind_socket", "create_app", "run_server"]
