"""One set of limits on every surface: the same values are accepted or refused by SpecEMConfig, the
engine, ``ChatSpecEM``, ``SpecEMLLM`` and the server's request parser, each refusal a typed error
naming the field; and ``/health``'s request counters add up.

Nothing here loads a model: the adapters check their settings at construction (they load on first
use), the server's parser is called directly, the engine runs a scripted member.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from scripted import ScriptedMember

from specem_core import SpecEM, SpecEMConfig
from specem_core.errors import ConfigError, ContextWindowError
from specem_core.vocabulary import ALIASES

# (surface name, value, accepted): the surface name is what ChatSpecEM, SpecEMLLM and the server
# take; SpecEMConfig and the engine take the field it stands for (specem_core.vocabulary.ALIASES).
LIMITS: list[tuple[str, Any, bool]] = [
    ("temperature", 0.0, True),
    ("temperature", 2.0, True),
    ("temperature", 2.5, False),
    ("temperature", -0.1, False),
    ("max_tokens", 1, True),
    ("max_tokens", 512, True),
    ("max_tokens", 0, False),
    ("max_tokens", -3, False),
    ("stop", ["\n\n"], True),
    ("stop", [""], False),
    ("stop_sequences", ["END"], True),
    ("stop_sequences", [""], False),
    ("max_retries", 0, True),
    ("max_retries", 3, True),
    ("max_retries", -1, False),
]

SURFACES = ["SpecEMConfig", "engine", "ChatSpecEM", "SpecEMLLM", "server"]


def _field(name: str) -> str:
    return ALIASES.get(name, name)


def _config(name: str, value: Any) -> None:
    SpecEMConfig(**{_field(name): value})


def _engine(name: str, value: Any) -> None:
    engine = SpecEM([ScriptedMember("a", drafts=[("Hello there.", True)])], SpecEMConfig(max_new_tokens=8))
    result = engine.generate("hi", **{_field(name): value})
    assert result.text


def _chat_specem(name: str, value: Any) -> None:
    pytest.importorskip("langchain_core")
    from specem_integrations.langchain import ChatSpecEM

    ChatSpecEM(**{name: value})  # loads nothing: the preset's members load on first use


def _specem_llm(name: str, value: Any) -> None:
    pytest.importorskip("llama_index.core")
    from specem_integrations.llamaindex import SpecEMLLM

    SpecEMLLM(**{name: value})


def _server(name: str, value: Any) -> None:
    pytest.importorskip("starlette")
    from specem_integrations.server._protocol import build_call, parse_request

    body = {"model": "specem", "messages": [{"role": "user", "content": "hi"}], name: value}
    build_call(parse_request(body), SpecEMConfig(), members=["a"])


CALLS: dict[str, Callable[[str, Any], None]] = {
    "SpecEMConfig": _config,
    "engine": _engine,
    "ChatSpecEM": _chat_specem,
    "SpecEMLLM": _specem_llm,
    "server": _server,
}


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize(("name", "value", "accepted"), LIMITS, ids=[f"{n}={v!r}" for n, v, _ in LIMITS])
def test_the_same_limits_on_every_surface(surface: str, name: str, value: Any, accepted: bool) -> None:
    call = CALLS[surface]
    if accepted:
        call(name, value)
        return
    if surface == "server":
        from specem_integrations.server import APIError

        with pytest.raises(APIError) as info:
            call(name, value)
        assert info.value.status == 400
        assert info.value.code == "invalid_value"
        assert info.value.param == name  # the parameter as the client wrote it
        return
    # ConfigError, or pydantic's ValidationError wrapping the same check: both ValueErrors naming the field
    with pytest.raises(ValueError, match=rf"{name}|{_field(name)}") as caught:
        call(name, value)
    message = str(caught.value)
    assert name in message or _field(name) in message, message
    if surface in ("SpecEMConfig", "engine"):
        assert isinstance(caught.value, ConfigError)


def test_the_temperature_message_is_the_same_everywhere() -> None:
    """Above 2 the members draft noise: every surface refuses it with the same sentence."""
    from specem_integrations.server import APIError

    messages = []
    for surface in SURFACES:
        with pytest.raises((ValueError, APIError)) as info:
            CALLS[surface]("temperature", 2.5)
        messages.append(str(info.value))
    assert all("temperature must be between 0 and 2, got 2.5" in m for m in messages), messages


def test_stop_and_stop_sequences_together_are_refused_by_the_server() -> None:
    from specem_integrations.server import APIError
    from specem_integrations.server._protocol import build_call, parse_request

    body = {"messages": [{"role": "user", "content": "hi"}], "stop": ["a"], "stop_sequences": ["b"]}
    with pytest.raises(APIError) as info:
        build_call(parse_request(body), SpecEMConfig())
    assert info.value.param == "stop_sequences"


def test_top_level_aliases_reach_the_engine_on_the_server() -> None:
    """``stop_sequences`` and ``max_retries`` at the top level are not dropped."""
    from specem_integrations.server._protocol import build_call, parse_request

    body = {"messages": [{"role": "user", "content": "hi"}], "stop_sequences": "END", "max_retries": 0}
    call = build_call(parse_request(body), SpecEMConfig())
    assert call.overrides["stop"] == ("END",)
    assert call.overrides["member_retries"] == 0


def test_health_counters_add_up() -> None:
    """Every request ends in exactly one outcome counter; a request refused before or after its
    slot is never left looking started-and-unfinished."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from specem_integrations.server import create_app

    member = ScriptedMember("a", drafts=[("Hello there.", True)])
    app = create_app(SpecEM([member], SpecEMConfig(max_new_tokens=8)), api_key="k" * 16)
    long_member = ScriptedMember(
        "b", fail_on={"open"}, errors={"open": ContextWindowError("the prompt is 9 tokens for member 'b'")}
    )
    too_long = create_app(SpecEM([long_member]), api_key="k" * 16)
    auth = {"Authorization": "Bearer " + "k" * 16}
    ok = {"model": "specem", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=ok, headers=auth).status_code == 200
        assert client.post("/v1/chat/completions", json={**ok, "temperature": 9}, headers=auth).status_code == 400
        assert client.post("/v1/chat/completions", json=ok).status_code == 401
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=auth).status_code == 200  # not a counted request
        counts = client.get("/health").json()["requests"]
    assert counts["received"] == 4
    assert counts["started"] == 1
    assert (counts["completed"], counts["invalid"]) == (1, 3)
    outcomes = ("completed", "cancelled", "timed_out", "rejected", "failed", "invalid")
    assert counts["received"] == sum(counts[k] for k in outcomes)
    with TestClient(too_long) as client:
        refused = client.post("/v1/chat/completions", json=ok, headers=auth)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        counts = client.get("/health").json()["requests"]
    # admitted, then refused by the engine: started, and finished as invalid (not left running)
    assert (counts["received"], counts["started"], counts["invalid"]) == (1, 1, 1)
    assert counts["received"] == sum(counts[k] for k in outcomes)


def test_the_context_window_error_says_how_to_raise_the_window() -> None:
    """The refusal names the member and its window, and says how to raise it (``n_ctx`` through
    ``member_kwargs``, ``load_member`` or the CLI's ``--n-ctx``)."""
    pytest.importorskip("transformers")
    import tiny

    from specem_core.backends.transformers import TransformersMember

    model, tok = tiny.tiny_qwen2(max_position_embeddings=64)
    small = TransformersMember(model, tok, name="small")
    msgs = [{"role": "user", "content": "The capital of France is Paris. " * 12}]
    with pytest.raises(ContextWindowError) as info:
        SpecEM([small]).generate(msgs)
    message = str(info.value)
    assert "'small', whose context window is 64" in message
    assert "member_kwargs={'n_ctx': 4096}" in message
    assert "load_member(..., n_ctx=...)" in message
    assert "--n-ctx 4096" in message
