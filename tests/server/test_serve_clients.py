"""Framework clients pointed at ``specem serve``: LangChain ``ChatOpenAI`` and LlamaIndex ``OpenAILike``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel
from serve_process import ServeProcess


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class City(BaseModel):
    """A city and its country."""

    name: str
    country: str


@pytest.fixture(scope="module")
def llm(open_server: ServeProcess) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=open_server.base_url,
        api_key="not-checked",
        model="specem",
        max_tokens=12,
        temperature=0,
        max_retries=0,
    )


def test_chat_openai_invoke_and_stream(llm: ChatOpenAI) -> None:
    message = llm.invoke("What is the capital of France?")
    assert isinstance(message, AIMessage)
    assert isinstance(message.content, str)
    assert message.content
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    assert message.usage_metadata is not None
    assert message.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream("What is the capital of France?", stream_usage=True))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(str(c.content) for c in chunks) == message.content
    merged: Any = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.usage_metadata["output_tokens"] == message.usage_metadata["output_tokens"]


def test_chat_openai_bind_tools_and_tool_results(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([multiply], tool_choice="multiply").bind(max_tokens=36)
    message = bound.invoke("What is 6 times 7? Use the multiply tool.")
    assert isinstance(message, AIMessage)
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "multiply"
    assert set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())
    assert message.response_metadata["finish_reason"] == "tool_calls"

    streamed: Any = None
    for chunk in bound.stream("What is 6 times 7? Use the multiply tool."):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "multiply"
    assert streamed.tool_calls[0]["args"] == call["args"]

    # the tool result goes back as a ToolMessage; the server accepts the whole conversation and,
    # with the tools still offered but not to be called, answers it in text
    result = multiply.invoke(call["args"])
    follow_up = llm.bind_tools([multiply], tool_choice="none").invoke(
        [
            HumanMessage("What is 6 times 7? Use the multiply tool."),
            message,
            ToolMessage(str(result), tool_call_id=call["id"]),
        ]
    )
    assert isinstance(follow_up, AIMessage)
    assert follow_up.tool_calls == []
    assert isinstance(follow_up.content, str)
    assert follow_up.content.strip()
    assert "<tool_call>" not in follow_up.content
    assert follow_up.response_metadata["finish_reason"] in ("stop", "length")


def test_chat_openai_with_structured_output(llm: ChatOpenAI) -> None:
    """``json_schema`` (langchain-openai's default: a strict ``response_format`` parsed by the openai
    SDK), ``function_calling`` (a forced tool call) and ``json_mode``, all through the server."""
    llm = llm.model_copy(update={"max_tokens": 40})
    question = "The Eiffel Tower is in Paris, France. Give the city and the country."
    city = llm.with_structured_output(City, method="json_schema").invoke(question)
    assert city == City(name="Paris", country="France")
    called = llm.with_structured_output(City, method="function_calling").invoke(question)
    assert isinstance(called, City)
    raw = llm.with_structured_output(City, method="json_mode", include_raw=True).invoke(question)
    assert isinstance(raw, dict)
    # json_mode sends no schema (the keys are the model's), but the answer is one whole JSON object
    assert isinstance(json.loads(str(raw["raw"].content)), dict)


def test_llamaindex_openai_like(open_server: ServeProcess) -> None:
    llm = OpenAILike(
        model="specem",
        api_base=open_server.base_url,
        api_key="not-checked",
        is_chat_model=True,
        context_window=8192,
        max_tokens=8,
        temperature=0,
        max_retries=0,
    )
    completion = llm.complete("What is the capital of France?")
    assert completion.text
    chat = llm.chat([ChatMessage(role="user", content="What is the capital of France?")])
    assert chat.message.content == completion.text
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content="Name a colour.")]))
    assert streamed
