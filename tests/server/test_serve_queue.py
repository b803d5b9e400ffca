"""A client that goes away while its request waits in the queue: the request is dropped there,
never runs (no member session is opened for it) and the slots it waited for serve the others.

``open_server`` runs two requests at once and queues four; two long streams take the slots.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
from serve_process import ServeProcess

LONG = {
    "model": "specem",
    "messages": [{"role": "user", "content": "Write a very long story about a dragon and a knight."}],
    "max_tokens": 4000,
    "stream": True,
    "specem": {"ignore_eos": True, "segment_len": 3},
}


@contextlib.contextmanager
def _raw_request(server: ServeProcess, body: dict[str, Any]) -> Iterator[socket.socket]:
    """Send a complete POST over a plain socket and keep the connection open (closing the socket
    is the client going away; nothing is read)."""
    url = urlsplit(server.url)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    try:
        sock.sendall(head + payload)
        yield sock
    finally:
        sock.close()


def test_a_client_gone_while_queued_is_dropped_without_running(open_server: ServeProcess) -> None:
    before = open_server.wait_idle(60)
    url = f"{open_server.base_url}/chat/completions"
    queued_body = {"model": "specem", "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}
    with (
        httpx.stream("POST", url, json=LONG, timeout=60) as first,
        httpx.stream("POST", url, json=LONG, timeout=60) as second,
    ):
        assert (first.status_code, second.status_code) == (200, 200)
        running = open_server.wait_health(timeout=60.0, requests_in_flight=2)
        assert running["sessions_opened_total"] == before["sessions_opened_total"] + 2
        with _raw_request(open_server, queued_body):
            waiting = open_server.wait_health(timeout=60.0, requests_queued=1)
            assert waiting["requests_in_flight"] == 2
        # the socket is closed: the queued request leaves the queue, counted as cancelled
        gone = open_server.wait_health(timeout=60.0, requests_queued=0, requests_in_flight=2)
        deadline = time.monotonic() + 30
        while gone["requests"]["cancelled"] == before["requests"]["cancelled"] and time.monotonic() < deadline:
            time.sleep(0.05)
            gone = open_server.health()
        assert gone["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
        assert gone["sessions_opened_total"] == before["sessions_opened_total"] + 2  # it never ran
        assert gone["sessions_open"] == 2
    after = open_server.wait_idle(60)
    assert after["sessions_opened_total"] == before["sessions_opened_total"] + 2
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 3  # and the two streams
    assert after["requests"]["completed"] == before["requests"]["completed"]
