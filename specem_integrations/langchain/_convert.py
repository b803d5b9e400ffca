"""LangChain messages to SpecEM's chat dicts, and SpecEM results to LangChain messages."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk

from specem_core.tools import new_call_id
from specem_core.types import GenerationResult

_TEXT_BLOCKS = ("text", "text-plain")
_SKIPPED_IN_AI = ("tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call", "reasoning", "thinking")
_CHAT_ROLES = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
    "tool": "tool",
}


def _text(message: BaseMessage, index: int) -> str:
    """The text of a message; non-text content blocks raise ``ValueError``."""
    content = message.content
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"message {index} ({message.type}) has content of type {type(content).__name__}")
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _TEXT_BLOCKS and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif isinstance(message, AIMessage) and kind in _SKIPPED_IN_AI:
            continue  # tool calls travel in message.tool_calls; reasoning is not replayed
        else:
            raise ValueError(
                f"message {index} ({message.type}) has a content block of type {kind!r}; "
                "SpecEM members read text only (text blocks are supported, images, audio and files are not)"
            )
    return "".join(parts)


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as OpenAI / chat-template dicts.

    Raises:
        ValueError: an empty list, an unknown ``ChatMessage`` role, or a non-text content block.
        TypeError: a message type SpecEM cannot use.
    """
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, BaseMessage):
            raise TypeError(f"message {i} is a {type(m).__name__}, not a LangChain message")
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m, i)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text(m, i)})
        elif isinstance(m, AIMessage):
            msg: dict[str, Any] = {"role": "assistant", "content": _text(m, i)}
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": tc.get("id") or new_call_id(),
                        "type": "function",
                        "function": {"name": tc["name"], "arguments": dict(tc["args"])},
                    }
                    for tc in m.tool_calls
                ]
            out.append(msg)
        elif isinstance(m, ToolMessage):
            text = _text(m, i)
            if m.status == "error" and not text.lower().startswith("error"):
                text = f"Error: {text}"
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": m.tool_call_id, "content": text}
            if m.name:
                tool["name"] = m.name
            out.append(tool)
        elif isinstance(m, FunctionMessage):
            out.append({"role": "tool", "name": m.name, "content": _text(m, i)})
        elif isinstance(m, ChatMessage):
            role = _CHAT_ROLES.get(m.role)
            if role is None:
                raise ValueError(f"message {i} has role {m.role!r}; use one of {', '.join(sorted(_CHAT_ROLES))}")
            out.append({"role": role, "content": _text(m, i)})
        else:
            raise TypeError(
                f"message {i}: unsupported message type {type(m).__name__}; "
                "use System, Human, AI, Tool or Chat messages"
            )
    return out


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """Token usage in the first member's tokens (as SpecEM reports it); ``input_token_details``
    has ``cache_read``: prompt tokens read from the members' prefix caches, summed over members
    (as langchain-openai maps OpenAI's ``cached_tokens``)."""
    return UsageMetadata(
        input_tokens=result.usage.prompt_tokens,
        output_tokens=result.usage.completion_tokens,
        total_tokens=result.usage.total_tokens,
        input_token_details=InputTokenDetails(cache_read=result.usage.cached_tokens),
    )


def response_metadata(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """``model_name``, ``finish_reason`` and the SpecEM trace (:meth:`GenerationResult.trace`)."""
    return {"model_name": model_name, "finish_reason": result.finish_reason, "specem": result.trace()}


def to_ai_message(result: GenerationResult, model_name: str) -> AIMessage:
    """The final answer as an ``AIMessage`` with tool calls, usage and the trace."""
    return AIMessage(
        content=result.content or "",
        tool_calls=[tool_call(name=c.name, args=dict(c.arguments), id=c.id) for c in result.tool_calls],
        invalid_tool_calls=[
            invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error) for c in result.invalid_tool_calls
        ],
        usage_metadata=usage_metadata(result),
        response_metadata=response_metadata(result, model_name),
    )


def final_chunk(delta: str, result: GenerationResult, model_name: str) -> AIMessageChunk:
    """The last stream chunk: remaining text, tool-call chunks, usage and metadata (once)."""
    chunks = [
        tool_call_chunk(name=c.name, args=json.dumps(c.arguments, ensure_ascii=False), id=c.id, index=n)
        for n, c in enumerate(result.tool_calls)
    ]
    chunks += [
        tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=len(chunks) + n)
        for n, c in enumerate(result.invalid_tool_calls)
    ]
    return AIMessageChunk(
        content=delta,
        tool_call_chunks=chunks,
        usage_metadata=usage_metadata(result),
        response_metadata=response_metadata(result, model_name),
        chunk_position="last",
    )
