"""SpecEM as an OpenAI-compatible HTTP server (``specem serve``; ``.venv/bin/pip install -e '.[server]'``
after ``scripts/install.sh``).

    from specem_core import SpecEM, load_member
    from specem_integrations.server import create_app

    app = create_app(SpecEM([load_member("smollm2")]), api_key=None, max_concurrency=4)
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: ``POST /v1/chat/completions`` (JSON and SSE streaming, tools, ``response_format``),
``GET /v1/models``, ``GET /health``. See :mod:`specem_integrations.server.app` for the design.
"""

from __future__ import annotations

from specem_integrations.server._errors import APIError
from specem_integrations.server._protocol import SpecEMOptions
from specem_integrations.server.app import create_app
from specem_integrations.server.run import bind_socket, run_server

__all__ = ["APIError", "SpecEMOptions", "bind_socket", "create_app", "run_server"]
