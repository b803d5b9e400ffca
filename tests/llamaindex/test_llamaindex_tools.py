"""Tool calling, query engines and agents, wired end to end through the real engine.

Scripted members (tests/scripted.py) decide what is drafted, so these tests check the wiring
exactly: schemas reach the engine, tool calls come back as ``ToolCallBlock`` s (also on the last
streamed response), agents run the Python tool and answer with its result. The same flows on the
real packaged models are in ``test_llamaindex_real.py`` (slow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ReActAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.tools import FunctionTool
from scripted import ScriptedMember, ScriptedSession

from specem_core import InputError, SessionRequest, SpecEM, SpecEMConfig
from specem_integrations.llamaindex import SpecEMLLM

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": "6", "b": 7}}\n</tool_call>'


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@dataclass
class ConversationMember(ScriptedMember):
    """Drafts from a script chosen by the conversation: before / after a tool result."""

    before: list[tuple[str, bool]] = field(default_factory=list)
    after: list[tuple[str, bool]] = field(default_factory=list)
    requests: list[SessionRequest] = field(default_factory=list)

    def open(self, request: SessionRequest) -> ScriptedSession:
        self.requests.append(request)
        last = request.messages[-1]
        answered = last.get("role") == "tool" or str(last.get("content", "")).startswith("Observation:")
        self.drafts = self.after if answered else self.before
        return ScriptedSession(self, request)


def engine_with(member: ScriptedMember) -> SpecEM:
    judge = ScriptedMember("judge", can_draft=False)
    return SpecEM([member, judge], SpecEMConfig(max_new_tokens=64))  # type: ignore[list-item]


def tool_llm(**kwargs: Any) -> tuple[SpecEMLLM, ConversationMember]:
    member = ConversationMember(
        "alpha",
        before=[("Let me compute. ", False), (CALL, True)],
        after=[("The product is ", False), ("42.", True)],
    )
    return SpecEMLLM(engine=engine_with(member), **kwargs), member


def test_chat_with_tools_returns_tool_call_blocks() -> None:
    llm, member = tool_llm()
    response = llm.chat_with_tools([FunctionTool.from_defaults(multiply)], "What is 6 times 7?")
    schemas = member.requests[-1].tools
    assert schemas is not None
    assert schemas[0]["function"]["name"] == "multiply"
    calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert len(calls) == 1
    assert calls[0].tool_name == "multiply"
    assert calls[0].tool_kwargs == {"a": 6, "b": 7}  # "6" coerced by the schema
    assert str(calls[0].tool_call_id).startswith("call_")
    assert response.message.content == "Let me compute."
    assert response.additional_kwargs["finish_reason"] == "tool_calls"
    assert response.raw["tool_calls"][0]["name"] == "multiply"
    selections = llm.get_tool_calls_from_response(response)
    assert [(s.tool_name, s.tool_kwargs) for s in selections] == [("multiply", {"a": 6, "b": 7})]


def test_streamed_tool_calls_arrive_on_the_last_response_without_markup() -> None:
    llm, _ = tool_llm()
    responses = list(llm.stream_chat_with_tools([multiply], "What is 6 times 7?"))
    assert all("<tool_call>" not in (r.message.content or "") for r in responses)
    assert all("<tool_call>" not in (r.delta or "") for r in responses)
    assert not any(isinstance(b, ToolCallBlock) for r in responses[:-1] for b in r.message.blocks)
    last = responses[-1]
    assert llm.get_tool_calls_from_response(last)[0].tool_kwargs == {"a": 6, "b": 7}
    assert "".join(r.delta or "" for r in responses) == last.message.content == "Let me compute."


async def test_async_tool_calls() -> None:
    llm, _ = tool_llm()
    response = await llm.achat_with_tools([multiply], "What is 6 times 7?")
    assert llm.get_tool_calls_from_response(response)[0].tool_name == "multiply"
    gen = await llm.astream_chat_with_tools([multiply], "What is 6 times 7?")
    responses = [r async for r in gen]
    assert llm.get_tool_calls_from_response(responses[-1])[0].tool_kwargs == {"a": 6, "b": 7}


def test_predict_and_call_runs_the_python_tool() -> None:
    llm, _ = tool_llm()
    out = llm.predict_and_call([FunctionTool.from_defaults(multiply)], "What is 6 times 7?")
    assert out.response == "42"
    assert out.sources[0].tool_name == "multiply"


def test_the_history_of_a_tool_turn_reaches_the_members_and_is_not_mutated() -> None:
    llm, member = tool_llm()
    history = [
        ChatMessage(role="user", content="What is 6 times 7?"),
        ChatMessage(
            role="assistant",
            blocks=[ToolCallBlock(tool_call_id="call_1", tool_name="multiply", tool_kwargs={"a": 6, "b": 7})],
        ),
        ChatMessage(role="tool", content="42", additional_kwargs={"tool_call_id": "call_1"}),
    ]
    before = [m.model_dump() for m in history]
    response = llm.chat_with_tools([multiply], chat_history=history)
    assert [m.model_dump() for m in history] == before
    assert response.message.content == "The product is 42."
    sent = member.requests[-1].messages
    assert sent[1]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    assert sent[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "multiply"}


def test_tool_choice_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    llm, _ = tool_llm()
    seen: list[dict[str, Any]] = []
    original = SpecEM.stream

    def spy(self: SpecEM, messages: Sequence[Any], **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(self, messages, **kwargs)

    monkeypatch.setattr(SpecEM, "stream", spy)
    llm.chat_with_tools([multiply], "6*7?", tool_required=True)
    llm.chat_with_tools([multiply], "6*7?", tool_choice="multiply", allow_parallel_tool_calls=True)
    llm.chat_with_tools([multiply], "6*7?", tool_choice="none")
    assert [(k["tool_choice"], k["parallel_tool_calls"]) for k in seen] == [
        ("required", False),
        ("multiply", True),
        ("none", False),
    ]
    with pytest.raises(InputError, match="not one of the tools"):
        llm.chat_with_tools([multiply], "6*7?", tool_choice="divide")


def test_invalid_tool_calls_are_reported_in_the_trace() -> None:
    member = ConversationMember(
        "alpha", before=[('<tool_call>\n{"name": "multiply", "arguments": {"a": "x"}}\n</tool_call>', True)]
    )
    llm = SpecEMLLM(engine=engine_with(member))
    response = llm.chat_with_tools([multiply], "6*7?")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    assert response.additional_kwargs["invalid_tool_calls"]


@pytest.mark.parametrize("streaming", [True, False])
async def test_function_agent_calls_the_tool_and_uses_its_result(streaming: bool) -> None:
    llm, member = tool_llm()
    calls: list[tuple[int, int]] = []

    def mult(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    agent = FunctionAgent(tools=[FunctionTool.from_defaults(mult, name="multiply")], llm=llm, streaming=streaming)
    handler = agent.run("What is 6 times 7?")
    results = [ev async for ev in handler.stream_events() if isinstance(ev, ToolCallResult)]
    output = await handler
    assert calls == [(6, 7)]
    assert results[0].tool_output.content == "42"
    assert "42" in str(output)
    assert output.response.content == "The product is 42."
    # the second turn saw the call and its result
    roles = [m["role"] for m in member.requests[-1].messages]
    assert roles[-2:] == ["assistant", "tool"]


async def test_react_agent_parses_the_ensembles_text_and_calls_the_tool() -> None:
    member = ConversationMember(
        "alpha",
        before=[
            ("Thought: I need to use a tool.\nAction: multiply\n", False),
            ('Action Input: {"a": 6, "b": 7}', True),
        ],
        after=[("Thought: I can answer now.\n", False), ("Answer: The product is 42.", True)],
    )
    llm = SpecEMLLM(engine=engine_with(member))
    agent = ReActAgent(tools=[FunctionTool.from_defaults(multiply)], llm=llm)
    handler = agent.run("What is 6 times 7?")
    events = [ev async for ev in handler.stream_events()]
    output = await handler
    tool_results = [ev for ev in events if isinstance(ev, ToolCallResult)]
    assert tool_results[0].tool_kwargs == {"a": 6, "b": 7}
    assert tool_results[0].tool_output.content == "42"
    assert any(isinstance(ev, AgentStream) and ev.delta for ev in events)
    assert str(output) == "The product is 42."


@pytest.mark.parametrize("streaming", [False, True])
def test_query_engine_with_mock_embeddings(streaming: bool) -> None:
    member = ConversationMember("alpha", before=[("The launch code ", False), ("is 7319.", True)])
    llm = SpecEMLLM(engine=engine_with(member))
    docs = [Document(text="The launch code of project Zephyr is 7319."), Document(text="Bananas are yellow.")]
    index = VectorStoreIndex.from_documents(docs, embed_model=MockEmbedding(embed_dim=8))
    engine = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=streaming)
    response = engine.query("What is the launch code of project Zephyr?")
    text = "".join(response.response_gen) if streaming else str(response)  # type: ignore[union-attr]
    assert text == "The launch code is 7319."
    prompt = "\n".join(str(m.get("content", "")) for m in member.requests[-1].messages)
    assert "The launch code of project Zephyr is 7319." in prompt  # the retrieved context
    assert "What is the launch code of project Zephyr?" in prompt
