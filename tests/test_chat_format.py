"""Rendering a conversation into a member's own prompt (``specem_core.chat_format``)."""

from __future__ import annotations

import json
from typing import Any

from specem_core.chat_format import ChatFormat, JinjaChatTemplate, arguments_as_objects

# the part of Qwen2.5's template that renders tools, past calls and tool results
QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


def history(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "What is 12 times 7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "84"},
    ]


def test_past_calls_reach_the_template_as_objects_whatever_shape_the_framework_sent() -> None:
    """LangChain and LlamaIndex send arguments as a JSON string; the template's ``tojson`` must
    see an object, or the model reads ``"arguments": "{\\"a\\": 12, ...}"`` (quoted twice)."""
    chat = ChatFormat(JinjaChatTemplate(QWEN_LIKE), QWEN_LIKE)
    assert chat.supports_tools
    as_string = chat.render(history(json.dumps({"a": 12, "b": 7})), [TOOL])
    as_object = chat.render(history({"a": 12, "b": 7}), [TOOL])
    assert as_string == as_object
    assert '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n</tool_call>' in as_string
    assert '\\"' not in as_string
    assert as_string.endswith("<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_arguments_as_objects_leaves_everything_else_alone() -> None:
    messages = [
        *history("not json"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c2", "function": {"name": "f", "arguments": "[1]"}}],
        },
        {"role": "user", "content": '{"a": 1}'},
    ]
    out = arguments_as_objects(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert out[3]["tool_calls"][0]["function"]["arguments"] == "[1]"  # only objects are arguments
    assert out[4] == {"role": "user", "content": '{"a": 1}'}
    assert out == messages
    assert out is not messages
    fixed = arguments_as_objects(history('{"a": 12, "b": 7}'))
    assert fixed[1]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "multiply", "arguments": {"a": 12, "b": 7}},
    }
    assert isinstance(history('{"a": 1}')[1]["tool_calls"][0]["function"]["arguments"], str)  # input not changed
