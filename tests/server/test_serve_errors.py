"""Every error path answers 4xx with an OpenAI-style body, and the server keeps serving."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import openai
import pytest
from serve_process import ServeProcess, openai_error, serving

OK_MESSAGES = [{"role": "user", "content": "Say hi."}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}

BAD_REQUESTS: list[tuple[str, Any, int, str | None, str]] = [
    # (id, body: dict, or bytes sent as is; status; param; code: never null, as the README's table promises)
    ("malformed-json", b'{"model": "specem", "messages": [', 400, None, "invalid_json"),
    ("empty-body", b"", 400, None, "invalid_json"),
    ("not-an-object", b"[1, 2]", 400, None, "invalid_json"),
    ("missing-messages", {"model": "specem"}, 400, "messages", "missing_required_parameter"),
    ("max-tokens-string", {"messages": OK_MESSAGES, "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ("max-tokens-zero", {"messages": OK_MESSAGES, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("temperature-string", {"messages": OK_MESSAGES, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("temperature-range", {"messages": OK_MESSAGES, "temperature": 3.5}, 400, "temperature", "invalid_value"),
    ("stream-string", {"messages": OK_MESSAGES, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("stop-number", {"messages": OK_MESSAGES, "stop": 5}, 400, "stop", "invalid_type"),
    ("content-number", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ("bad-role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "invalid_type"),
    ("empty-messages", {"messages": []}, 400, "messages", "invalid_value"),
    ("empty-prompt", {"messages": [{"role": "user", "content": "  "}]}, 400, "messages", "invalid_value"),
    (
        "image-content",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
        "messages[0].content[0].type",
        "unsupported_content",
    ),
    ("n-2", {"messages": OK_MESSAGES, "n": 2}, 400, "n", "unsupported_parameter"),
    ("logprobs", {"messages": OK_MESSAGES, "logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    ("penalty", {"messages": OK_MESSAGES, "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    (
        "bad-tool-name",
        {"messages": OK_MESSAGES, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        400,
        "tools",
        "invalid_tools",
    ),
    ("tools-not-list", {"messages": OK_MESSAGES, "tools": {"name": "x"}}, 400, "tools", "invalid_type"),
    (
        "tool-params-not-object",
        {"messages": OK_MESSAGES, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        400,
        "tools",
        "invalid_tools",
    ),
    (
        "unknown-tool-choice",
        {"messages": OK_MESSAGES, "tools": [TOOL], "tool_choice": "nope"},
        400,
        "tool_choice",
        "invalid_tools",
    ),
    (
        "tool-choice-without-tools",
        {"messages": OK_MESSAGES, "tool_choice": "required"},
        400,
        "tool_choice",
        "invalid_tools",
    ),
    (
        "tools-and-format",
        {"messages": OK_MESSAGES, "tools": [TOOL], "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "invalid_tools",
    ),
    (
        "bad-format",
        {"messages": OK_MESSAGES, "response_format": {"type": "yaml"}},
        400,
        "response_format",
        "invalid_value",
    ),
    ("specem-unknown", {"messages": OK_MESSAGES, "specem": {"turbo": True}}, 400, "specem.turbo", "unknown_parameter"),
    (
        "segment-len-0",
        {"messages": OK_MESSAGES, "specem": {"segment_len": 0}},
        400,
        "specem.segment_len",
        "invalid_value",
    ),
    ("unknown-model", {"model": "gpt-4o", "messages": OK_MESSAGES}, 404, "model", "model_not_found"),
]


def _assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    error = openai_error(response, status)
    assert error["type"] in ("invalid_request_error", "not_found_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_answers_openai_error(
    open_server: ServeProcess, name: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    url = f"{open_server.base_url}/chat/completions"
    for stream in (False, True):
        if isinstance(body, bytes):
            if stream:
                continue
            response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        else:
            response = httpx.post(url, json={**body, "stream": body.get("stream", stream)}, timeout=60)
        _assert_openai_error(response, status, param, code)
    assert open_server.health()["status"] == "ok"


def test_context_overflow_is_400_context_length_exceeded(open_server: ServeProcess) -> None:
    long_prompt = "word " * 12000  # SmolLM2's window is 8192 tokens
    client = openai.OpenAI(base_url=open_server.base_url, api_key="x", max_retries=0, timeout=120)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="specem", messages=[{"role": "user", "content": long_prompt}], max_tokens=4, stream=stream
            )  # streaming too: the error comes before the stream starts
        assert info.value.status_code == 400
        assert info.value.code == "context_length_exceeded"
        assert info.value.param == "messages"
    assert open_server.wait_idle(30)["sessions_open"] == 0


def test_routes_and_methods(open_server: ServeProcess) -> None:
    missing = httpx.get(f"{open_server.base_url}/nothing-here", timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{open_server.base_url}/chat/completions", timeout=30)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    model = httpx.get(f"{open_server.base_url}/models/other", timeout=30)
    _assert_openai_error(model, 404, "model", "model_not_found")


def test_still_serving_after_errors(open_server: ServeProcess) -> None:
    """A malformed request is counted as invalid, and the next request is answered normally."""
    before = open_server.wait_idle(30)
    url = f"{open_server.base_url}/chat/completions"
    assert httpx.post(url, content=b"{", timeout=30).status_code == 400
    response = httpx.post(url, json={"model": "specem", "messages": OK_MESSAGES, "max_tokens": 4}, timeout=120)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]
    after = open_server.wait_idle(30)
    assert after["requests"]["invalid"] == before["requests"]["invalid"] + 1
    assert after["requests"]["completed"] == before["requests"]["completed"] + 1
    assert after["requests"]["failed"] == 0


def test_failing_members_are_500_and_the_server_keeps_serving() -> None:
    """A server whose only member is an OpenAI-compatible server that is down: every request fails
    inside the engine (500 ``all_members_failed``), and the server answers the next one."""
    with socket.socket() as probe:  # a loopback port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with serving(["--model", f"openai:http://127.0.0.1:{port}/v1#ghost", "--no-access-log"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(
                    model="specem", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream
                )
            assert info.value.status_code == 500
            assert info.value.code == "all_members_failed"
            assert "ghost" in info.value.message
        bad = httpx.post(f"{server.base_url}/chat/completions", json={"messages": []}, timeout=30)
        _assert_openai_error(bad, 400, "messages", None)
        health = server.health()
        assert health["requests"]["failed"] == 2
        assert health["sessions_open"] == 0
