"""More limits and refusals of ``specem serve``: bodies over 16 MiB (413), OpenAI parameters and
content parts SpecEM cannot honour (400), and the 500 ``internal_error`` path (an OpenAI error body
whose request id is the one the server logs)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from scripted import ScriptedMember, ScriptedSession
from serve_process import ServeProcess, openai_error

from specem_core import SessionRequest, SpecEM, SpecEMConfig

MAX_BODY = 16 * 1024 * 1024  # specem serve's default limit on a request body
OK_MESSAGES = [{"role": "user", "content": "Say hi."}]


def _assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str) -> dict[str, Any]:
    error = openai_error(response, status)
    assert error["param"] == param, error
    assert error["code"] == code, error
    return error


def _oversized_body() -> bytes:
    """A valid chat request just over 16 MiB (one huge user message)."""
    head = b'{"model": "specem", "max_tokens": 2, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    return head + b"a" * (MAX_BODY + 1 - len(head) - len(tail) + 1024) + tail


# -- 413 -----------------------------------------------------------------------------------------
def test_a_body_over_16_mib_is_413_request_too_large(open_server: ServeProcess) -> None:
    before = open_server.wait_idle(60)
    url = f"{open_server.base_url}/chat/completions"
    body = _oversized_body()
    assert len(body) > MAX_BODY
    json.loads(body)  # a well-formed request: only its size is wrong

    # with a Content-Length: refused from the header
    declared = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=120)
    error = _assert_openai_error(declared, 413, None, "request_too_large")
    assert error["type"] == "invalid_request_error"
    assert str(MAX_BODY) in error["message"]

    # chunked, with no Content-Length: refused while reading, once 16 MiB are passed
    def chunks() -> Iterator[bytes]:
        step = 1 << 20
        for start in range(0, len(body), step):
            yield body[start : start + step]

    streamed = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=120)
    assert "content-length" not in streamed.request.headers
    _assert_openai_error(streamed, 413, None, "request_too_large")

    after = open_server.wait_idle(60)
    assert after["requests"]["invalid"] == before["requests"]["invalid"] + 2
    assert after["sessions_opened_total"] == before["sessions_opened_total"]  # no model work was done
    # the server keeps serving
    ok = httpx.post(url, json={"model": "specem", "messages": OK_MESSAGES, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200, ok.text


# -- 400 for what SpecEM cannot honour -------------------------------------------------------------
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}
FILE = {"type": "file", "file": {"file_id": "file-abc123", "filename": "notes.pdf"}}
UNSUPPORTED: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, body, param, code)
    (
        "frequency-penalty",
        {"messages": OK_MESSAGES, "frequency_penalty": 0.5},
        "frequency_penalty",
        "unsupported_parameter",
    ),
    ("logit-bias", {"messages": OK_MESSAGES, "logit_bias": {"1234": 5}}, "logit_bias", "unsupported_parameter"),
    (
        "input-audio-part",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Transcribe:"}, AUDIO]}]},
        "messages[0].content[1].type",
        "unsupported_content",
    ),
    (
        "file-part",
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [FILE]}]},
        "messages[1].content[0].type",
        "unsupported_content",
    ),
]


@pytest.mark.parametrize(("name", "body", "param", "code"), UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_parameters_and_content_are_400(
    open_server: ServeProcess, name: str, body: dict[str, Any], param: str, code: str
) -> None:
    url = f"{open_server.base_url}/chat/completions"
    before = open_server.wait_idle(60)
    for stream in (False, True):
        response = httpx.post(url, json={"model": "specem", **body, "stream": stream}, timeout=60)
        error = _assert_openai_error(response, 400, param, code)
        assert error["type"] == "invalid_request_error"
    after = open_server.wait_idle(60)
    assert after["requests"]["invalid"] == before["requests"]["invalid"] + 2
    assert after["sessions_opened_total"] == before["sessions_opened_total"]  # refused before any model work


def test_a_zero_frequency_penalty_and_an_empty_logit_bias_are_accepted(open_server: ServeProcess) -> None:
    """They ask for nothing SpecEM cannot do (OpenAI clients often send the defaults)."""
    body = {"model": "specem", "messages": OK_MESSAGES, "max_tokens": 2, "frequency_penalty": 0, "logit_bias": {}}
    response = httpx.post(f"{open_server.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text


def test_a_lone_surrogate_in_stop_is_400_on_stop(open_server: ServeProcess) -> None:
    """Stop strings are configuration (a ConfigError in the engine): 400 ``invalid_value`` on ``stop``."""
    body = json.dumps({"model": "specem", "messages": OK_MESSAGES, "stop": ["ok", "x\ud800"]})
    assert "\\ud800" in body  # sent as a JSON escape, as a client would
    response = httpx.post(
        f"{open_server.base_url}/chat/completions",
        content=body.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    error = _assert_openai_error(response, 400, "stop", "invalid_value")
    assert "lone surrogate (U+D800)" in error["message"]


# -- 500 internal_error ----------------------------------------------------------------------------
class _CounterBugError(Exception):
    """Not a SpecEM error: what a bug in a backend raises."""


class _BrokenCountSession(ScriptedSession):
    @property
    def prompt_tokens(self) -> int:  # read by the engine outside the guarded member calls
        raise _CounterBugError("token counter out of sync (internal detail)")


class _BrokenCountMember(ScriptedMember):
    def open(self, request: SessionRequest) -> ScriptedSession:
        self.calls.append("open")
        return _BrokenCountSession(self, request)


def test_an_unexpected_exception_is_500_internal_error_with_the_logged_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No real request makes the engine raise anything but its own errors (a member's failures
    are caught, retried and reported as ``all_members_failed``), so the app is served in-process
    over an engine whose member session raises a non-SpecEM exception where the engine does not
    guard member calls (its token count)."""
    from starlette.testclient import TestClient

    from specem_integrations.server.app import create_app

    member = _BrokenCountMember("broken", drafts=[("hi", True)])
    app = create_app(SpecEM([member], SpecEMConfig(max_new_tokens=4)))
    ids = []
    with TestClient(app) as client, caplog.at_level(logging.ERROR, logger="specem.server"):
        for stream in (False, True):
            body = {"model": "specem", "messages": OK_MESSAGES, "stream": stream}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 500, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"], error["param"]) == ("server_error", "internal_error", None)
            assert "internal detail" not in error["message"]  # what went wrong stays in the log
            found = re.search(r"request id ([0-9a-f]{32})", error["message"])
            assert found, error["message"]
            assert found.group(1) == response.headers["x-request-id"] == response.json()["request_id"]
            ids.append(found.group(1))
        health = client.get("/health").json()
    assert ids[0] != ids[1]
    for request_id in ids:
        logged = [r for r in caplog.records if r.name == "specem.server" and request_id in r.getMessage()]
        assert len(logged) == 1, caplog.text
        assert logged[0].levelno == logging.ERROR
        assert logged[0].exc_info is not None
        assert logged[0].exc_info[0] is _CounterBugError  # the log keeps the traceback
    assert health["requests"]["failed"] == 2
    assert health["sessions_open"] == 0  # the engine closed the session it had opened
    assert member.calls.count("close") == 2
