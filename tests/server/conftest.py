"""Real ``specem serve`` processes on loopback over the packaged SmolLM2-135M-Instruct.

``open_server``: no authentication, two requests at once, four waiting.
``auth_server``: a bearer key, one request at once, one waiting, a 6-second request timeout
(for 401, 429 and 504).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_process import SERVER_KEY, ServeProcess, start_serve


@pytest.fixture(scope="session")
def open_server() -> Iterator[ServeProcess]:
    server = start_serve(
        [
            "--model",
            "smollm2",
            "--max-concurrency",
            "2",
            "--queue",
            "4",
            "--max-new-tokens",
            "16",
            "--request-timeout",
            "120",
        ]
    )
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def auth_server() -> Iterator[ServeProcess]:
    server = start_serve(
        [
            "--model",
            "smollm2",
            "--max-concurrency",
            "1",
            "--queue",
            "1",
            "--max-new-tokens",
            "16",
            "--request-timeout",
            "4",
            "--served-model-name",
            "ensemble-a",
        ],
        api_key=SERVER_KEY,
    )
    try:
        yield server
    finally:
        server.cleanup()
