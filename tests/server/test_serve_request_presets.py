"""A preset named per request (``specem.preset``): its settings apply when its members are the
server's, explicit fields override them, and anything else is a 400 on ``specem.preset``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from serve_process import ServeProcess, openai_error

from specem_core import SpecEMConfig
from specem_core.presets import get_preset
from specem_integrations.server._errors import APIError
from specem_integrations.server._protocol import build_call, parse_request

FAST = list(get_preset("fast").members)


def _call(specem: dict[str, Any], members: list[str]) -> Any:
    body = {"messages": [{"role": "user", "content": "hi"}], "specem": specem}
    return build_call(parse_request(body), SpecEMConfig(), members=members)


def test_a_preset_whose_members_are_the_servers_sets_its_fields() -> None:
    call = _call({"preset": "fast"}, list(reversed(FAST)))  # member order does not matter
    expected = dict(get_preset("fast").config)
    assert expected  # the preset changes something, or this test checks nothing
    assert {k: call.overrides[k] for k in expected} == expected
    assert all(call.params[k] == "specem.preset" for k in expected)


def test_explicit_fields_override_the_presets() -> None:
    call = _call({"preset": "fast", "exit_temperature": 0.7, "model_exit": False}, FAST)
    assert call.overrides["exit_temperature"] == 0.7
    assert call.overrides["model_exit"] is False
    assert call.overrides["normalization"] == get_preset("fast").config["normalization"]


@pytest.mark.parametrize(
    ("preset", "members", "message"),
    [
        ("fastest", FAST, "fast"),  # unknown: the message lists the names
        ("quality", FAST, "this server runs"),  # another pair of members
    ],
)
def test_a_preset_that_cannot_apply_is_400_on_specem_preset(preset: str, members: list[str], message: str) -> None:
    with pytest.raises(APIError) as info:
        _call({"preset": preset}, members)
    assert info.value.status == 400
    body = info.value.body()["error"]
    assert body["param"] == "specem.preset"
    assert body["code"] == "invalid_value"
    assert message in body["message"]


def test_the_server_refuses_a_preset_of_other_members(open_server: ServeProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "specem": {"preset": "quality"}}
    response = httpx.post(f"{open_server.base_url}/chat/completions", json=body, timeout=60)
    error = openai_error(response, 400)
    assert error["param"] == "specem.preset"
    assert "start a server with --preset quality" in error["message"]
