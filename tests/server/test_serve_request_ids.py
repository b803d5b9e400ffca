"""``X-Request-ID``: taken from the client when valid (else made), returned on every response and in
every error body, and carried into every log line of the request, from the event loop, the
engine's worker thread and the member pool's threads alike; JSON logs (``--log-format json``) in
a real ``specem serve`` process.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from scripted import ScriptedMember, ScriptedSession
from serve_process import serving

from specem_core import SessionRequest, SpecEM, SpecEMConfig

pytest.importorskip("starlette", reason="the server extra is not installed (pip install -e '.[server]')")
from starlette.testclient import TestClient

from specem_integrations.server._logging import JsonFormatter, TextFormatter
from specem_integrations.server._request_ids import RequestIdFilter
from specem_integrations.server.app import create_app

QUESTION = [{"role": "user", "content": "Name a colour."}]
HEX32 = re.compile(r"[0-9a-f]{32}")
MEMBER_LOG = "specem.test.member"


@pytest.fixture
def client(tiny_members: list[Any]) -> Iterator[TestClient]:
    app = create_app(SpecEM(tiny_members[:1], SpecEMConfig(max_new_tokens=3)))
    with TestClient(app) as test_client:
        yield test_client


# -- the header ------------------------------------------------------------------------------------
def test_a_valid_client_id_comes_back_and_the_answer_keeps_its_own_id(client: TestClient) -> None:
    for given in ("req-1", "01HZX3J4K5M6N7P8Q9R0S1T2U3", "Root=1-5f84c7a1-7d1e/abc+def==", "a" * 128):
        response = client.post("/v1/chat/completions", json={"messages": QUESTION}, headers={"X-Request-ID": given})
        assert response.status_code == 200
        assert response.headers["x-request-id"] == given
        completion_id = response.json()["id"]
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", completion_id)  # a client's id may repeat; answer ids do not
        assert given not in completion_id


def test_without_a_header_an_id_is_made_and_names_the_answer(client: TestClient) -> None:
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json={"messages": QUESTION, "stream": stream})
        request_id = response.headers["x-request-id"]
        assert HEX32.fullmatch(request_id)
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            assert {chunk["id"] for chunk in chunks} == {f"chatcmpl-{request_id}"}
        else:
            assert response.json()["id"] == f"chatcmpl-{request_id}"
    assert HEX32.fullmatch(client.get("/health").headers["x-request-id"])  # every route has one


@pytest.mark.parametrize(
    "given",
    ["has space", "a" * 129, 'quote"d', "semi;colon", "caf\u00e9", "tab\tinside", "<script>"],
    ids=["space", "129-chars", "quote", "semicolon", "non-ascii", "tab", "angle"],
)
def test_an_invalid_client_id_is_replaced_by_a_new_one(client: TestClient, given: str) -> None:
    response = client.get("/health/live", headers={"X-Request-ID": given.encode()})
    assert response.status_code == 200
    assert HEX32.fullmatch(response.headers["x-request-id"])


def test_every_error_body_carries_the_request_id(client: TestClient) -> None:
    cases = [
        ("POST", "/v1/chat/completions", {"messages": []}, 400),
        ("POST", "/v1/chat/completions", {"model": "other", "messages": QUESTION}, 404),
        ("GET", "/no/such/route", None, 404),
        ("GET", "/v1/chat/completions", None, 405),
    ]
    for n, (method, path, body, status) in enumerate(cases):
        given = f"err-{n}"
        response = client.request(method, path, json=body, headers={"X-Request-ID": given})
        assert response.status_code == status, response.text
        assert response.headers["x-request-id"] == given
        payload = response.json()
        assert payload["request_id"] == given
        assert set(payload["error"]) == {"message", "type", "param", "code"}  # the OpenAI shape is kept


class _FailsInRoundTwo(ScriptedSession):
    def draft(self, max_tokens: int, sampling: Any, **kwargs: Any) -> Any:
        if self.round >= 1:
            raise RuntimeError("the member's device fell over")
        return super().draft(max_tokens, sampling, **kwargs)


class _FailsInRoundTwoMember(ScriptedMember):
    def open(self, request: SessionRequest) -> ScriptedSession:
        self.calls.append("open")
        return _FailsInRoundTwo(self, request)


def test_an_error_event_inside_a_stream_carries_the_request_id() -> None:
    member = _FailsInRoundTwoMember("flaky", drafts=[("one ", False), ("two", True)])
    app = create_app(SpecEM([member], SpecEMConfig(max_new_tokens=8, member_retries=0)))
    with TestClient(app) as test_client:
        response = test_client.post(
            "/v1/chat/completions", json={"messages": QUESTION, "stream": True}, headers={"X-Request-ID": "mid-stream"}
        )
    assert response.status_code == 200  # the stream had started
    errors = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith('data: {"error"')]
    assert len(errors) == 1
    assert errors[0]["error"]["code"] == "all_members_failed"
    assert errors[0]["request_id"] == "mid-stream"


# -- log lines ---------------------------------------------------------------------------------------
class _LoggingSession(ScriptedSession):
    """Logs from each member call: the engine runs them in its worker thread or the member pool."""

    def draft(self, max_tokens: int, sampling: Any, **kwargs: Any) -> Any:
        logging.getLogger(MEMBER_LOG).info("%s drafts", self.member.name)
        return super().draft(max_tokens, sampling, **kwargs)

    def score(self, candidates: Any, *, score_eos: bool) -> Any:
        logging.getLogger(MEMBER_LOG).info("%s scores", self.member.name)
        return super().score(candidates, score_eos=score_eos)


class _LoggingMember(ScriptedMember):
    def open(self, request: SessionRequest) -> ScriptedSession:
        self.calls.append("open")
        return _LoggingSession(self, request)


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """JSON lines of the ``specem`` loggers, through the filter ``specem serve`` puts on its handler."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    loggers = [logging.getLogger(name) for name in ("specem.server", MEMBER_LOG)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_every_log_line_of_a_request_carries_its_id_from_every_thread(captured: io.StringIO) -> None:
    members = [  # two concurrency keys: the engine calls them from its member pool's threads
        _LoggingMember("left", drafts=[("red ", False), ("and blue", True)], concurrency_key="left"),
        _LoggingMember("right", drafts=[("green ", False), ("or grey", True)], concurrency_key="right"),
    ]
    app = create_app(SpecEM(members, SpecEMConfig(max_new_tokens=8)))
    ids = []
    with TestClient(app) as test_client:
        for n, stream in enumerate((False, True)):
            response = test_client.post(
                "/v1/chat/completions",
                json={"messages": QUESTION, "stream": stream},
                headers={"X-Request-ID": f"colour-{n}"},
            )
            assert response.status_code == 200
            ids.append(response.headers["x-request-id"])
        untagged = test_client.post("/v1/chat/completions", json={"messages": QUESTION})
        ids.append(untagged.headers["x-request-id"])
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert ids[:2] == ["colour-0", "colour-1"]
    for request_id in ids:
        mine = [line for line in lines if line["request_id"] == request_id]
        member_lines = [line for line in mine if line["logger"] == MEMBER_LOG]
        assert {line["message"] for line in member_lines} >= {"left drafts", "right drafts", "left scores"}
        summary = [line for line in mine if line["logger"] == "specem.server"]
        assert len(summary) == 1
        assert summary[0]["outcome"] == "completed"
        assert summary[0]["completion_id"].startswith("chatcmpl-")
        assert summary[0]["completion_tokens"] >= 1
    assert all(line["request_id"] in ids for line in lines)  # no line of a request lost its id


def test_the_text_format_ends_a_request_s_lines_with_its_id() -> None:
    record = logging.LogRecord("specem.server", logging.WARNING, __file__, 1, "member %s is slow", ("a",), None)
    RequestIdFilter().filter(record)
    assert TextFormatter().format(record) == "WARNING:  specem.server: member a is slow"
    record.request_id = "abc-1"
    assert TextFormatter().format(record) == "WARNING:  specem.server: member a is slow request_id=abc-1"


# -- a real process with JSON logs ---------------------------------------------------------------------
def test_json_logs_of_a_real_server_are_one_object_per_line_with_the_request_id() -> None:
    with serving(["--model", "smollm2", "--max-new-tokens", "4", "--log-format", "json"]) as server:
        url = f"{server.base_url}/chat/completions"
        ok = httpx.post(url, json={"messages": QUESTION}, headers={"X-Request-ID": "json-ok"}, timeout=120)
        assert ok.status_code == 200
        bad = httpx.post(url, json={"messages": []}, headers={"X-Request-ID": "json-bad"}, timeout=60)
        assert bad.status_code == 400
        server.wait_idle(60)
        assert server.stop() == 0
        log = server.log()
    lines = [json.loads(line) for line in log.splitlines() if line.strip()]  # each line parses on its own
    assert lines
    for line in lines:
        assert {"time", "level", "logger", "message", "request_id"} <= set(line), line
    assert any("listening on http://" in line["message"] for line in lines)
    ok_lines = [line for line in lines if line["request_id"] == "json-ok"]
    access = [line for line in ok_lines if line["logger"] == "uvicorn.access"]
    assert [(a["method"], a["path"], a["status"]) for a in access] == [("POST", "/v1/chat/completions", 200)]
    summary = [line for line in ok_lines if line["logger"] == "specem.server"]
    assert len(summary) == 1
    assert summary[0]["outcome"] == "completed"
    assert summary[0]["prompt_tokens"] > 0
    bad_lines = [line for line in lines if line["request_id"] == "json-bad"]
    assert [line["status"] for line in bad_lines if line["logger"] == "uvicorn.access"] == [400]


def test_an_unhandled_error_answers_500_with_the_request_id(tiny_members: list[Any]) -> None:
    """Starlette answers an exception no handler caught outside the middleware: the id is put back
    on that response (header and body) and on its log line."""
    from starlette.routing import Route

    def boom(request: Any) -> Any:
        raise RuntimeError("a bug (internal detail)")

    app = create_app(SpecEM(tiny_members[:1], SpecEMConfig(max_new_tokens=2)))
    app.router.routes.append(Route("/boom", boom))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    logging.getLogger("specem.server").addHandler(handler)
    try:
        with TestClient(app, raise_server_exceptions=False) as test_client:
            response = test_client.get("/boom", headers={"X-Request-ID": "boom-1"})
    finally:
        logging.getLogger("specem.server").removeHandler(handler)
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "boom-1"
    body = response.json()
    assert body["request_id"] == "boom-1"
    assert body["error"]["code"] == "internal_error"
    assert "internal detail" not in response.text
    logged = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["request_id"], line["level"]) for line in logged] == [("boom-1", "ERROR")]
    assert "a bug (internal detail)" in logged[0]["exception"]  # the traceback stays in the log
