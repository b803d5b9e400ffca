"""Message, content-block and tool conversion (pure functions, no model)."""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core.base.llms.types import (
    AudioBlock,
    CacheControl,
    CachePoint,
    ChatMessage,
    CitableBlock,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, ConfigDict
from llama_index.core.tools import FunctionTool, ToolMetadata

from specem_core import InputError
from specem_integrations.llamaindex._convert import (
    as_tool,
    resolve_tool_choice,
    to_engine_messages,
    to_openai_tools,
    tool_kwargs_dict,
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def test_roles_map_to_template_roles() -> None:
    msgs = [
        ChatMessage(role=MessageRole.SYSTEM, content="sys"),
        ChatMessage(role=MessageRole.DEVELOPER, content="dev"),
        ChatMessage(role=MessageRole.USER, content="hi"),
        ChatMessage(role=MessageRole.ASSISTANT, content="a"),
        ChatMessage(role=MessageRole.CHATBOT, content="b"),
        ChatMessage(role=MessageRole.MODEL, content="c"),
        ChatMessage(role=MessageRole.TOOL, content="42", additional_kwargs={"tool_call_id": "x"}),
        ChatMessage(role=MessageRole.FUNCTION, content="43", additional_kwargs={"name": "f"}),
    ]
    out = to_engine_messages(msgs)
    assert [m["role"] for m in out] == [
        "system",
        "system",
        "user",
        "assistant",
        "assistant",
        "assistant",
        "tool",
        "tool",
    ]
    assert [m["content"] for m in out] == ["sys", "dev", "hi", "a", "b", "c", "42", "43"]
    assert out[6]["tool_call_id"] == "x"
    assert out[7]["name"] == "f"


def test_text_blocks_join_and_non_prompt_blocks_are_dropped() -> None:
    msg = ChatMessage(
        role="user",
        blocks=[
            TextBlock(text="first"),
            ThinkingBlock(content="hidden reasoning"),
            CachePoint(cache_control=CacheControl(type="ephemeral")),
            CitableBlock(title="doc", source="s", content=[TextBlock(text="cited fact")]),
            TextBlock(text="second"),
        ],
    )
    assert to_engine_messages([msg]) == [{"role": "user", "content": "first\ncited fact\nsecond"}]


@pytest.mark.parametrize(
    ("block", "kind"),
    [
        (ImageBlock(image=b"\x89PNG....", image_mimetype="image/png"), "ImageBlock"),
        (AudioBlock(audio=b"RIFF", format="wav"), "AudioBlock"),
        (DocumentBlock(data=b"%PDF-1.4", document_mimetype="application/pdf"), "DocumentBlock"),
    ],
)
def test_non_text_content_is_refused_with_its_kind(block: Any, kind: str) -> None:
    msgs = [ChatMessage(role="system", content="s"), ChatMessage(role="user", blocks=[TextBlock(text="look"), block])]
    with pytest.raises(InputError, match=rf"message 1 \(user\) contains a {kind}"):
        to_engine_messages(msgs)


def test_empty_and_malformed_conversations() -> None:
    with pytest.raises(InputError, match="messages is empty"):
        to_engine_messages([])
    with pytest.raises(TypeError, match="sequence of ChatMessage"):
        to_engine_messages("hello")
    with pytest.raises(TypeError, match="message 0 must be a llama_index ChatMessage"):
        to_engine_messages([42])
    with pytest.raises(InputError, match="message 0 has unknown role 'narrator'"):
        to_engine_messages([{"role": "narrator", "content": "x"}])
    bad = ChatMessage.model_construct(role="wizard", blocks=[TextBlock(text="x")], additional_kwargs={})
    with pytest.raises(InputError, match="unknown role 'wizard'"):
        to_engine_messages([bad])


def test_dict_messages_are_accepted() -> None:
    assert to_engine_messages([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]


def test_assistant_tool_calls_and_tool_results() -> None:
    msgs = [
        ChatMessage(role="user", content="6 times 7?"),
        ChatMessage(
            role="assistant",
            blocks=[
                TextBlock(text=""),
                ToolCallBlock(tool_call_id="call_1", tool_name="multiply", tool_kwargs={"a": 6, "b": 7}),
                ToolCallBlock(tool_name="multiply", tool_kwargs='{"a": 1, "b": 2}'),
                ToolCallBlock(tool_call_id="call_3", tool_name="echo", tool_kwargs="not json"),
            ],
        ),
        ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "call_1"}),
    ]
    out = to_engine_messages(msgs)
    calls = out[1]["tool_calls"]
    assert calls[0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}},
    }
    assert calls[1]["function"]["arguments"] == {"a": 1, "b": 2}
    assert calls[1]["id"].startswith("call_")
    assert calls[2]["function"]["arguments"] == "not json"
    assert out[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "multiply"}


def test_legacy_additional_kwargs_tool_calls() -> None:
    msg = ChatMessage(
        role="assistant",
        content="",
        additional_kwargs={
            "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
        },
    )
    out = to_engine_messages([ChatMessage(role="user", content="q"), msg])
    assert out[1]["tool_calls"] == [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]


def test_tool_call_block_outside_assistant_is_refused() -> None:
    msg = ChatMessage(role="user", blocks=[ToolCallBlock(tool_name="f", tool_kwargs={})])
    with pytest.raises(InputError, match=r"message 0 \(user\) contains a ToolCallBlock"):
        to_engine_messages([msg])


def test_conversion_never_mutates_the_callers_messages() -> None:
    msgs = [
        ChatMessage(role="developer", content="d"),
        ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_name="f", tool_kwargs='{"a": 1}')]),
        ChatMessage(role="tool", content="1", additional_kwargs={"tool_call_id": "z"}),
    ]
    before = [m.model_dump() for m in msgs]
    to_engine_messages(msgs)
    assert [m.model_dump() for m in msgs] == before
    assert len(msgs) == 3


def test_tools_become_openai_schemas() -> None:
    def add(x: int, y: int = 1) -> int:
        """Add numbers."""
        return x + y

    schemas = to_openai_tools([FunctionTool.from_defaults(multiply), add])
    assert [s["function"]["name"] for s in schemas] == ["multiply", "add"]
    params = schemas[0]["function"]["parameters"]
    assert params["type"] == "object"
    assert set(params["properties"]) == {"a", "b"}
    assert params["required"] == ["a", "b"]
    assert "Multiply two integers" in schemas[0]["function"]["description"]
    assert schemas[0]["type"] == "function"


def test_tools_without_a_usable_schema_are_refused() -> None:
    nameless = FunctionTool(fn=multiply, metadata=ToolMetadata(description="x", name=None))
    with pytest.raises(InputError, match="tool 0 has no name"):
        to_openai_tools([nameless])

    class Opaque:
        pass

    class Weird(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        thing: Opaque

    unusable = FunctionTool(fn=multiply, metadata=ToolMetadata(description="x", name="weird", fn_schema=Weird))
    with pytest.raises(InputError, match="tool 'weird' has no usable JSON schema"):
        to_openai_tools([unusable])
    with pytest.raises(InputError, match="two tools are named 'multiply'"):
        to_openai_tools([multiply, multiply])
    with pytest.raises(TypeError, match="tool 0 must be a llama_index BaseTool"):
        to_openai_tools([42])
    with pytest.raises(InputError, match="invalid name 'not a tool'"):
        to_openai_tools([{"name": "not a tool"}])
    with pytest.raises(InputError, match="parameters must have type 'object'"):
        to_openai_tools([{"name": "f", "parameters": {"type": "string"}}])
    with pytest.raises(TypeError, match="tools must be a sequence"):
        to_openai_tools(multiply)  # type: ignore[arg-type]
    assert as_tool(multiply).metadata.name == "multiply"


def test_schema_dicts_pass_through_the_engines_check() -> None:
    schema = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    out = to_openai_tools([schema, {"name": "g"}])
    assert out[0]["function"]["name"] == "f"
    assert out[1] == {
        "type": "function",
        "function": {"name": "g", "description": "", "parameters": {"type": "object", "properties": {}}},
    }


def test_tool_choice_resolution() -> None:
    names = ["multiply", "add"]
    assert resolve_tool_choice(None, False, names) is None
    assert resolve_tool_choice(None, True, names) == "required"
    assert resolve_tool_choice("auto", True, names) == "required"
    assert resolve_tool_choice("none", False, names) == "none"
    assert resolve_tool_choice("any", False, names) == "required"
    assert resolve_tool_choice("add", False, names) == "add"
    assert resolve_tool_choice({"type": "function", "function": {"name": "multiply"}}, False, names) == "multiply"
    with pytest.raises(InputError, match="'divide', which is not one of the tools"):
        resolve_tool_choice("divide", False, names)
    with pytest.raises(InputError, match="tool_choice must be"):
        resolve_tool_choice(3, False, names)


def test_tool_kwargs_dict_is_lenient() -> None:
    assert tool_kwargs_dict({"a": 1}) == {"a": 1}
    assert tool_kwargs_dict('{"a": 1}') == {"a": 1}
    assert tool_kwargs_dict('{"a": 1') == {"a": 1}
    assert tool_kwargs_dict("") == {}
    assert tool_kwargs_dict("[1, 2]") == {}
