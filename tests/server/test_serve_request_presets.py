"""A preset named per request (``specem.preset``): its settings apply when its members are the
server's, explicit fields override them, and anything else is a 400 on ``specem.preset``. Parsed,
and served: a real ``specem serve`` on the ``fast`` preset's members (under the library defaults)
answers a request naming the preset with the preset's vote (softmax rows) and Model Exit, and the
same request without it, or with ``model_exit`` overridden, without an exit.

(The preset's trusted opening is not among them: it needs the preset's prior, which a per-request
preset does not bring to a server started without it, so there it has no effect.)"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serve_process import ServeProcess, openai_error, start_serve

from specem_core import SpecEMConfig
from specem_core.presets import PRESETS, get_preset
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


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_per_request_preset_applies_every_setting_the_preset_has(name: str) -> None:
    """Nothing a preset sets is dropped on the way (the request fields are derived from the
    config): ``quality``'s ``trusted_tool_calls`` was, while they were a hand-kept list."""
    preset = get_preset(name)
    call = _call({"preset": name}, list(preset.members))
    assert {k: call.overrides.get(k) for k in preset.config} == dict(preset.config)
    config = SpecEMConfig().replace(**call.overrides)
    assert all(getattr(config, k) == v for k, v in preset.config.items())


def test_explicit_fields_override_the_presets() -> None:
    call = _call({"preset": "fast", "model_exit_temperature": 0.7, "model_exit": False}, FAST)
    assert call.overrides["model_exit_temperature"] == 0.7
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


@pytest.fixture(scope="module")
def fast_members_server() -> Iterator[ServeProcess]:
    """The fast preset's members under the library defaults (members given, no ``--preset``)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/build_llama_cpp.sh builds and installs it)")
    args = [x for name in FAST for x in ("--model", name)]
    # no prefix cache: every request prefills its prompt in one batch, so the three compared below
    # get the same logits (a prompt read from the cache moves the 0.5B's by ~0.4: a near tie flips)
    args += ["--no-prefix-cache"]
    server = start_serve([*args, "--backend", "llamacpp", "--max-concurrency", "1", "--request-timeout", "300"])
    try:
        yield server
    finally:
        server.cleanup()


def _trace(server: ServeProcess, specem: dict[str, Any]) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": "Name three colours and say why you like them."}],
        "max_tokens": 80,
        "temperature": 0,
        "specem": {"trace": True, "ignore_eos": True, **specem},
    }
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    trace: dict[str, Any] = response.json()["specem"]
    assert len(trace["segments"]) >= 4
    return trace


@pytest.mark.slow
def test_a_served_request_naming_the_preset_runs_with_its_settings(fast_members_server: ServeProcess) -> None:
    fast = get_preset("fast").config
    assert (fast["normalization"], fast["model_exit"]) == ("softmax", True)  # what this test shows take effect
    defaults = SpecEMConfig()
    assert (defaults.normalization, defaults.model_exit) == ("sum", False)  # ... over the server's own settings
    plain = _trace(fast_members_server, {})
    preset = _trace(fast_members_server, {"preset": "fast"})
    overridden = _trace(fast_members_server, {"preset": "fast", "model_exit": False})
    first = [p["segments"][0] for p in (plain, preset, overridden)]
    # the same two first candidates (greedy), voted on differently: softmax rows sharpen the vote
    assert first[0]["candidates"] == first[1]["candidates"] == first[2]["candidates"]
    assert max(first[1]["combined"]) > max(first[0]["combined"]) + 0.05
    assert first[2]["combined"] == first[1]["combined"]  # still the preset's normalization
    # Model Exit: with the preset a member stops drafting; without it, or with it overridden, none does
    assert set(plain["members_per_round"]) == {2}
    assert 1 in preset["members_per_round"]
    assert set(overridden["members_per_round"]) == {2}
