"""Request validation in ``specem_core.types``: text that is not valid Unicode is bad input, named
where it is, before any member sees it."""

from __future__ import annotations

from typing import Any

import pytest
import tiny

from specem_core import ConfigError, InputError, SpecEM, SpecEMConfig
from specem_core.types import check_unicode, validate_messages

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.parametrize(
    ("messages", "where", "code"),
    [
        ("hi \ud800", "message 0 content", "U+D800"),
        ([{"role": "user", "content": "hi \ud800"}], "message 0 content", "U+D800"),
        (
            [{"role": "system", "content": "Be \udfff brief."}, {"role": "user", "content": "hi"}],
            "message 0 content",
            "U+DFFF",
        ),
        (
            [
                {"role": "user", "content": "weather?"},
                {"role": "tool", "content": "sunny \udcff", "tool_call_id": "call_1"},
            ],
            "message 1 content",
            "U+DCFF",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a \ud83d b"}]}],
            "message 0 content[0].text",
            "U+D83D",
        ),
        (
            [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "\ud800"}'}}
                    ],
                },
            ],
            "message 1 tool_calls[0].function.arguments",
            "U+D800",
        ),
        ([{"role": "user", "content": "hi", "name": "bob\udc80"}], "message 0 name", "U+DC80"),
    ],
)
def test_lone_surrogates_are_input_errors_naming_where(messages: Any, where: str, code: str) -> None:
    with pytest.raises(InputError, match="lone surrogate") as info:
        validate_messages(messages)
    message = str(info.value)
    assert message.startswith(f"{where} contains a lone surrogate ({code})")
    assert "which is not valid Unicode" in message


def test_undecodable_bytes_are_named() -> None:
    """``specem chat $'hi \\xff'``: Python hands the byte over as U+DCFF (surrogateescape)."""
    with pytest.raises(InputError, match=r"\(U\+DCFF\) at character 3, which is not valid Unicode \(byte 0xFF of"):
        validate_messages(b"hi \xff".decode("utf-8", "surrogateescape"))


def test_valid_unicode_passes_untouched() -> None:
    msgs = [{"role": "user", "content": "Café 中文 😀 \U0001f680", "name": "ünï"}]
    assert validate_messages(msgs) == msgs
    check_unicode({"a": ["x", {"b": "😀"}], "n": 3, "none": None, "raw": b"\xff"}, "value")
    loop: list[Any] = ["x"]
    loop += [loop, loop]  # a cycle is walked once
    check_unicode(loop, "value")


def test_check_unicode_names_the_path_and_can_raise_config_errors() -> None:
    with pytest.raises(InputError, match=r"^tools\[0\]\.function\.description contains a lone surrogate \(U\+D800\)"):
        check_unicode([{"function": {"description": "x\ud800"}}], "tools")
    with pytest.raises(ConfigError, match="at character 2"):
        check_unicode("ab\ud800", "stop", error=ConfigError)


@pytest.fixture(scope="module")
def engine() -> SpecEM:
    return SpecEM([tiny.member("llama"), tiny.member("qwen2")], SpecEMConfig(max_new_tokens=4))


def test_engine_rejects_a_lone_surrogate_before_the_members_see_it(engine: SpecEM) -> None:
    # before: the tokenizers raised TypeError in every member, reported as AllMembersFailedError
    with pytest.raises(InputError, match=r"^message 0 content contains a lone surrogate \(U\+D800\) at character 3"):
        engine.generate([{"role": "user", "content": "hi \ud800"}])
    with pytest.raises(InputError, match="message 1 content"):
        engine.generate([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\udcffhi"}])


def test_engine_rejects_lone_surrogates_in_tools_and_response_format(engine: SpecEM) -> None:
    bad_tool = {**TOOL, "function": {**TOOL["function"], "description": "Weather \ud800"}}  # type: ignore[dict-item]
    with pytest.raises(InputError, match=r"^tools\[0\]\.function\.description contains a lone surrogate"):
        engine.generate("Weather in Paris?", tools=[bad_tool])
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "description": "\udfff"}}}
    with pytest.raises(InputError, match=r"^response_format\.json_schema\.schema\.description contains"):
        engine.generate("A JSON object.", response_format=fmt)


def test_stop_strings_with_a_lone_surrogate_are_config_errors(engine: SpecEM) -> None:
    with pytest.raises(ConfigError, match=r"stop string 1 .* lone surrogate \(U\+D800\)"):
        SpecEMConfig(stop=("END", "x\ud800"))
    with pytest.raises(ConfigError, match="stop string 0"):
        engine.generate("hi", stop=["\udc80"])
