"""Conversions between LlamaIndex objects and the plain dicts the SpecEM engine takes.

Everything here is pure: no engine, no model, no I/O. The caller's messages, blocks and tools
are never mutated; every function builds new objects.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    BaseRecursiveContentBlock,
    CachePoint,
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.tools import BaseTool, FunctionTool

from specem_core.errors import InputError
from specem_core.tools import normalize_tool

ROLE_MAP: dict[str, str] = {
    MessageRole.SYSTEM.value: "system",
    MessageRole.DEVELOPER.value: "system",
    MessageRole.USER.value: "user",
    MessageRole.ASSISTANT.value: "assistant",
    MessageRole.CHATBOT.value: "assistant",  # Cohere's name for the assistant
    MessageRole.MODEL.value: "assistant",  # Gemini's name for the assistant
    MessageRole.TOOL.value: "tool",
    MessageRole.FUNCTION.value: "tool",  # legacy OpenAI function result
}
"""LlamaIndex role → chat-template role. ``developer`` becomes ``system`` because most member
templates (SmolLM2, Qwen2.5) only know ``system``."""

_DROPPED_BLOCKS = (ThinkingBlock, CachePoint)
"""Blocks that carry no prompt text for a text-only member: earlier reasoning and cache hints."""


def new_tool_call_id() -> str:
    """A fresh id for a tool call (local models do not emit ids)."""
    return f"call_{uuid.uuid4().hex[:12]}"


def _role_of(message: ChatMessage | Mapping[str, Any], index: int) -> str:
    raw = message.get("role") if isinstance(message, Mapping) else message.role
    value = raw.value if isinstance(raw, MessageRole) else raw
    if not isinstance(value, str) or value not in ROLE_MAP:
        known = ", ".join(ROLE_MAP)
        raise InputError(f"message {index} has unknown role {value!r}; expected one of {known}")
    return ROLE_MAP[value]


def _as_chat_message(message: object, index: int) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if isinstance(message, Mapping):
        _role_of(message, index)  # a clear error before pydantic's
        return ChatMessage.model_validate(dict(message))
    raise TypeError(
        f"message {index} must be a llama_index ChatMessage (or a dict with 'role' and 'content'), "
        f"got {type(message).__name__}"
    )


def _block_text(block: object, index: int, role: str, pieces: list[str]) -> None:
    """Append the text of one content block to ``pieces`` or raise for unsupported content."""
    if isinstance(block, TextBlock):
        pieces.append(block.text)
    elif isinstance(block, _DROPPED_BLOCKS):
        return
    elif isinstance(block, BaseRecursiveContentBlock):  # CitableBlock / CitationBlock: their text
        for nested in block.nested_blocks:
            _block_text(nested, index, role, pieces)
    else:
        kind = type(block).__name__
        raise InputError(
            f"message {index} ({role}) contains a {kind}; SpecEM members read text only, so only "
            "TextBlock (and citation blocks holding text) can be sent"
        )


def _arguments(kwargs: dict[str, Any] | str) -> dict[str, Any] | str:
    """Tool-call arguments as a dict when they parse (templates render them with ``tojson``)."""
    if isinstance(kwargs, dict):
        return dict(kwargs)
    try:
        parsed = json.loads(kwargs) if kwargs.strip() else {}
    except json.JSONDecodeError:
        return kwargs
    return parsed if isinstance(parsed, dict) else kwargs


def _legacy_tool_calls(raw: object, index: int) -> list[dict[str, Any]]:
    """OpenAI-style ``additional_kwargs["tool_calls"]`` from older LlamaIndex code."""
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise InputError(f"message {index} (assistant) has additional_kwargs['tool_calls'] that is not a list")
    calls: list[dict[str, Any]] = []
    for call in raw:
        data = call.model_dump() if hasattr(call, "model_dump") else call
        if not isinstance(data, Mapping):
            raise InputError(f"message {index} (assistant) has a tool call that is not a mapping: {call!r}")
        fn = data.get("function", data)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InputError(f"message {index} (assistant) has a tool call without a function name")
        args = fn.get("arguments", {}) if isinstance(fn, Mapping) else {}
        calls.append(
            {
                "id": str(data.get("id") or new_tool_call_id()),
                "type": "function",
                "function": {"name": name, "arguments": _arguments(args if args is not None else {})},
            }
        )
    return calls


def to_engine_messages(messages: object) -> list[dict[str, Any]]:
    """Convert LlamaIndex chat messages into the engine's ``{"role", "content", ...}`` dicts.

    * roles: see :data:`ROLE_MAP`; anything else is an error;
    * content: text blocks are joined with newlines (as ``ChatMessage.content`` does); thinking and
      cache-point blocks are dropped; images, audio, video and documents are refused;
    * an assistant's ``ToolCallBlock`` s become ``tool_calls`` (OpenAI/HF shape, arguments as a
      dict, an id made up when missing);
    * a tool result keeps ``additional_kwargs["tool_call_id"]`` and gets the tool's ``name``
      from the matching earlier call (some templates print it).

    Raises:
        InputError: empty conversation, unknown role, unsupported content, a tool call outside
            an assistant message.
        TypeError: ``messages`` is not a sequence of ``ChatMessage`` (or dicts).
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a sequence of ChatMessage, got {type(messages).__name__}")
    if len(messages) == 0:
        raise InputError("messages is empty: give at least one ChatMessage")
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for index, item in enumerate(messages):
        message = _as_chat_message(item, index)
        role = _role_of(message, index)
        pieces: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in message.blocks:
            if isinstance(block, ToolCallBlock):
                if role != "assistant":
                    raise InputError(f"message {index} ({role}) contains a ToolCallBlock; only assistant messages can")
                if not block.tool_name:
                    raise InputError(f"message {index} (assistant) has a ToolCallBlock without a tool name")
                call_id = block.tool_call_id or new_tool_call_id()
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": block.tool_name, "arguments": _arguments(block.tool_kwargs)},
                    }
                )
            else:
                _block_text(block, index, role, pieces)
        extra = message.additional_kwargs or {}
        if role == "assistant" and not calls and extra.get("tool_calls"):
            calls = _legacy_tool_calls(extra["tool_calls"], index)
        converted: dict[str, Any] = {"role": role, "content": "\n".join(pieces)}
        if calls:
            converted["tool_calls"] = calls
            for call in calls:
                call_names[call["id"]] = call["function"]["name"]
        if role == "tool":
            result_id = extra.get("tool_call_id")
            if result_id is not None:
                converted["tool_call_id"] = str(result_id)
            tool_name = extra.get("name") or extra.get("tool_name") or call_names.get(str(result_id))
            if tool_name:
                converted["name"] = str(tool_name)
        out.append(converted)
    return out


def to_openai_tools(tools: Sequence[BaseTool | Callable[..., Any] | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style tool schemas (what chat templates take) for LlamaIndex tools.

    Plain Python functions are wrapped with ``FunctionTool.from_defaults``; schema dicts (the
    output of :meth:`SpecEMLLM._prepare_chat_with_tools`) are checked and passed on. Every
    schema goes through :func:`specem_core.tools.normalize_tool`, the engine's own check.

    Raises:
        InputError: a tool without a name, a schema that cannot be built or is not an object
            schema, or two tools with the same name.
        TypeError: something that is neither a ``BaseTool``, a callable nor a schema dict.
    """
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a sequence of llama_index tools, got {type(tools).__name__}")
    schemas: list[dict[str, Any]] = []
    seen: set[str] = set()
    for position, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            schema = normalize_tool(tool, position)
        else:
            schema = _tool_schema(as_tool(tool, position), position)
        name = schema["function"]["name"]
        if name in seen:
            raise InputError(f"two tools are named {name!r}; tool names must be unique")
        seen.add(name)
        schemas.append(schema)
    return schemas


def as_tool(tool: object, position: int = 0) -> BaseTool:
    """``tool`` itself when it is a ``BaseTool``; a ``FunctionTool`` over a plain callable."""
    if isinstance(tool, BaseTool):
        return tool
    if callable(tool):
        try:
            return FunctionTool.from_defaults(fn=tool)
        except Exception as exc:
            label = getattr(tool, "__name__", repr(tool))
            raise InputError(f"tool {position} ({label}) cannot be turned into a FunctionTool: {exc}") from exc
    raise TypeError(f"tool {position} must be a llama_index BaseTool or a Python function, got {type(tool).__name__}")


def _tool_schema(tool: BaseTool, position: int) -> dict[str, Any]:
    meta = tool.metadata
    raw_name = getattr(meta, "name", None)
    if not isinstance(raw_name, str) or not raw_name.strip():
        raise InputError(f"tool {position} has no name; give it one (FunctionTool.from_defaults(fn, name=...))")
    try:
        schema = meta.to_openai_tool(skip_length_check=True)
    except Exception as exc:
        raise InputError(f"tool {raw_name!r} has no usable JSON schema: {exc}") from exc
    function = schema.get("function") if isinstance(schema, Mapping) else None
    params = function.get("parameters") if isinstance(function, Mapping) else None
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise InputError(f"tool {raw_name!r} has no usable JSON schema: its parameters must be a JSON object schema")
    return normalize_tool(
        {
            "type": "function",
            "function": {
                "name": function["name"],  # type: ignore[index]
                "description": str(function.get("description") or ""),  # type: ignore[union-attr]
                "parameters": dict(params),
            },
        },
        position,
    )


def resolve_tool_choice(tool_choice: object, tool_required: bool, tool_names: Sequence[str]) -> str | None:
    """Normalize LlamaIndex's ``tool_choice`` / ``tool_required`` into ``None``, ``"auto"``,
    ``"none"``, ``"required"`` or a tool name.

    Accepts OpenAI's dict form (``{"type": "function", "function": {"name": ...}}``).

    Raises:
        InputError: an unknown tool name or an unusable value.
    """
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        tool_choice = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
    if tool_choice is None:
        return "required" if tool_required else None
    if not isinstance(tool_choice, str) or not tool_choice:
        raise InputError(f"tool_choice must be 'auto', 'none', 'required' or a tool name, got {tool_choice!r}")
    if tool_choice in ("auto", "none", "required"):
        if tool_required and tool_choice == "auto":
            return "required"
        return tool_choice
    if tool_choice == "any":
        return "required"
    if tool_choice not in tool_names:
        raise InputError(f"tool_choice names {tool_choice!r}, which is not one of the tools: {', '.join(tool_names)}")
    return tool_choice


def tool_kwargs_dict(kwargs: dict[str, Any] | str) -> dict[str, Any]:
    """Arguments of a ``ToolCallBlock`` as a dict (string arguments are parsed leniently)."""
    if isinstance(kwargs, dict):
        return kwargs
    if not kwargs.strip():
        return {}
    try:
        parsed = parse_partial_json(kwargs)
    except (ValueError, TypeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}
