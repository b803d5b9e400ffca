"""Liveness and readiness apart: ``/health/live`` answers while the process serves HTTP,
``/health/ready`` once the members are loaded and probed (503 before, and from the start of
shutdown); ``/health`` keeps its load and counters, plus ``ready`` and ``draining``.

Server members (``openai:``) are probed in the background; a server that is down is injected
through a transport that refuses connections until the test "starts" it (then the in-process
OpenAI-compatible fake answers). The real-process checks use the session's ``specem serve``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest
from fake_openai_server import CHATML, FakeServer
from serve_process import SERVER_KEY, ServeProcess, serving

from specem_core import SpecEM, SpecEMConfig

pytest.importorskip("starlette", reason="the server extra is not installed (pip install -e '.[server]')")
from starlette.testclient import TestClient

from specem_integrations.server.app import create_app

HEALTH_KEYS = {
    "status",
    "model",
    "members",
    "max_concurrency",
    "queue",
    "requests_in_flight",
    "requests_queued",
    "sessions_open",
    "sessions_opened_total",
    "engine_workers",
    "decode_batching",
    "requests",
    "uptime_s",
}


def test_local_members_are_ready_at_once_and_health_keeps_its_fields(tiny_members: list[Any]) -> None:
    app = create_app(SpecEM(tiny_members[:2], SpecEMConfig(max_new_tokens=2)))
    with TestClient(app) as client:
        live = client.get("/health/live")
        ready = client.get("/health/ready")
        health = client.get("/health")
    assert (live.status_code, live.json()) == (200, {"status": "alive"})
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "ready": True, "members": {"llama": "ok", "qwen2": "ok"}}
    assert health.status_code == 200
    body = health.json()
    assert set(body) == HEALTH_KEYS | {"ready", "draining"}  # what it had, and the two new fields
    assert (body["status"], body["ready"], body["draining"]) == ("ok", True, False)


def test_draining_turns_readiness_off_and_leaves_liveness_on(tiny_members: list[Any]) -> None:
    app = create_app(SpecEM(tiny_members[:1], SpecEMConfig(max_new_tokens=2)))
    with TestClient(app) as client:
        app.state.specem.begin_draining()  # what the SIGTERM / SIGINT handler calls
        ready = client.get("/health/ready")
        assert client.get("/health/live").status_code == 200
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert ready.status_code == 503
    assert ready.json()["status"] == "draining"
    assert (health["status"], health["ready"], health["draining"]) == ("ok", False, True)
    assert "specem_ready 0.0" in metrics
    assert "specem_draining 1.0" in metrics


def test_the_first_exit_signal_starts_draining() -> None:
    """``specem serve``'s uvicorn server calls the app's ``begin_draining`` on the first SIGTERM or
    SIGINT (a second signal, uvicorn's forced exit, calls nothing more)."""
    import uvicorn

    from specem_integrations.server.run import _server_class

    calls: list[str] = []
    server = _server_class()(
        uvicorn.Config(app=lambda *_: None), None, None, begin_draining=lambda: calls.append("drain")
    )
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit
    assert calls == ["drain"]
    server.handle_exit(signal.SIGINT, None)
    assert calls == ["drain"]


class _Switch:
    """A member's server that is down until ``up()``: connections are refused, then the fake answers."""

    def __init__(self) -> None:
        self.server = FakeServer(dialect="vllm")
        self.running = threading.Event()

    def handler(self, request: httpx.Request) -> httpx.Response:
        if not self.running.is_set():
            raise httpx.ConnectError("connection refused", request=request)
        return self.server.handler(request)


def _remote(switch: _Switch, name: str) -> Any:
    from specem_core.backends.http.client import BreakerPolicy, RetryPolicy
    from specem_core.backends.http.member import OpenAIHTTPMember

    return OpenAIHTTPMember(
        f"http://{name}.test/v1",
        name=name,
        chat_template=CHATML,
        end_of_turn="<|im_end|>",
        transport=httpx.MockTransport(switch.handler),
        retry=RetryPolicy(max_retries=0, backoff_base=0.001, backoff_max=0.001),
        breaker=BreakerPolicy(enabled=False),
    )


def _wait_ready(client: TestClient, timeout: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    response = client.get("/health/ready")
    while response.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        response = client.get("/health/ready")
    return response


def test_a_server_member_makes_the_app_ready_only_once_its_server_answers() -> None:
    switch = _Switch()
    app = create_app(SpecEM([_remote(switch, "remote")], SpecEMConfig(max_new_tokens=4)))
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        not_yet = client.get("/health/ready")
        while not_yet.json()["status"] == "probing" and time.monotonic() < deadline:
            time.sleep(0.05)
            not_yet = client.get("/health/ready")
        assert not_yet.status_code == 503
        assert not_yet.json()["status"] == "unavailable"
        assert "ConnectError" in not_yet.json()["members"]["remote"]
        assert client.get("/health/live").status_code == 200  # alive all along
        assert client.get("/health").json()["ready"] is False
        switch.running.set()  # the member's server comes up: the retried probe finds it
        ready = _wait_ready(client)
        assert ready.status_code == 200, ready.json()
        assert ready.json()["members"] == {"remote": "ok"}
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Capital?"}]})
    assert answer.status_code == 200, answer.text


def test_a_local_drafter_makes_the_app_ready_while_a_server_member_is_down(tiny_members: list[Any]) -> None:
    switch = _Switch()
    app = create_app(SpecEM([tiny_members[0], _remote(switch, "down")], SpecEMConfig(max_new_tokens=2)))
    with TestClient(app) as client:
        ready = _wait_ready(client)
    assert ready.status_code == 200
    members = ready.json()["members"]
    assert members["llama"] == "ok"
    assert "ConnectError" in members["down"]  # named, and left to the per-request path


# -- a real process ------------------------------------------------------------------------------------
def test_a_real_server_answers_its_probes_without_the_key(auth_server: ServeProcess) -> None:
    url = auth_server.url
    assert httpx.get(f"{url}/health/live", timeout=30).json() == {"status": "alive"}
    ready = httpx.get(f"{url}/health/ready", timeout=30)
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    assert httpx.get(f"{url}/health", timeout=30).json()["ready"] is True
    # /metrics is not a probe: with --api-key-env it needs the key
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401
    scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {SERVER_KEY}"}, timeout=30)
    assert scraped.status_code == 200
    assert "specem_ready 1.0" in scraped.text


def test_sigterm_makes_a_real_server_draining_while_its_answer_finishes() -> None:
    """A real ``specem serve`` process on SIGTERM: ``/health/ready`` never answers 200 again: 503
    ``draining`` until uvicorn notices the signal (it checks every 0.1 s), then the connection is
    refused (uvicorn stops accepting, docs/guides/deploying.md). The answer in flight still
    finishes whole, and the process exits 0.

    The probes go over a keep-alive connection opened before the signal, so that the first one
    usually reaches the server inside that window; on a loaded machine it may not (a CI run saw
    the connection refused at once), which the guide allows, so a 503 is not required here. The
    wiring from the signal to ``begin_draining`` is checked without that race by
    ``test_the_first_exit_signal_starts_draining``."""
    with serving(["--model", "smollm2", "--graceful-timeout", "240", "--no-access-log"], exit_probe=True) as server:
        body = {
            "model": "specem",
            "messages": [{"role": "user", "content": "Write a very long story about a dragon and a knight."}],
            "max_tokens": 40,
            "stream": True,
            "specem": {"ignore_eos": True},
        }
        with httpx.Client(timeout=10) as probe:
            assert probe.get(f"{server.url}/health/ready").status_code == 200
            with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=300) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                server.process.send_signal(signal.SIGTERM)  # shutdown starts while the answer streams
                seen: list[tuple[int, str]] = []
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        ready = probe.get(f"{server.url}/health/ready")
                    except httpx.ConnectError:  # no longer accepting connections
                        break
                    except httpx.TransportError:  # the kept-alive connection was closed: reconnect
                        continue
                    seen.append((ready.status_code, ready.json()["status"]))
                else:
                    pytest.fail(f"new connections were still accepted 30 s after SIGTERM: {seen[-3:]}")
                rest = [line for line in lines if line.startswith("data: ")]
        assert set(seen) <= {(503, "draining")}, seen  # never ready again once the signal is sent
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        server.check_clean_exit(server.process.wait(timeout=300))
