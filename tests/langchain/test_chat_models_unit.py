"""ChatSpecEM without real models: the standard unit suite, message conversion, streaming rules,
tools, structured output and bad input (tiny random models and script-following members)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from langchain_tests.unit_tests import ChatModelUnitTests
from lc_engines import tiny_engine
from lc_script_member import FollowScript, fixed
from pydantic import BaseModel, ValidationError
from typing_extensions import TypedDict

from specem_core import SpecEM, SpecEMConfig
from specem_integrations.langchain import ChatSpecEM
from specem_integrations.langchain._convert import to_engine_messages


class TestChatSpecEMStandardUnit(ChatModelUnitTests):
    """The standard unit suite on the default pair, named (nothing is loaded by these tests)."""

    @property
    def chat_model_class(self) -> type[ChatSpecEM]:
        return ChatSpecEM

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "paper"}  # the SmolLM2 + Qwen-0.5B preset, by name: nothing is loaded

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # an ensemble has no single model id to swap per call


@tool
def magic_function(input: int) -> int:
    """Apply a magic function to an input."""
    return input + 2


@tool
def get_weather(city: str) -> str:
    """Get the weather in a city."""
    return "sunny"


CALL = '<tool_call>\n{"name": "magic_function", "arguments": {"input": 3}}\n</tool_call>'


def scripted(*members: FollowScript, **config: Any) -> ChatSpecEM:
    engine = SpecEM(list(members), SpecEMConfig(**{"segment_len": 4, "max_new_tokens": 64, **config}))
    return ChatSpecEM(engine=engine)


def tool_or_text(text: str) -> FollowScript:
    """Calls magic_function(3) when tools are bound and no tool result is there yet."""

    def script(request: Any) -> str:
        if request.tools and request.messages[-1]["role"] != "tool":
            return CALL
        if request.messages[-1]["role"] == "tool":
            return f"The result is {request.messages[-1]['content']}."
        return text

    return FollowScript("caller", script)


# -- construction ------------------------------------------------------------------------------
def test_construction_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import specem_core.registry as registry

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded at construction")

    monkeypatch.setattr(registry, "load_member", boom)
    llm = ChatSpecEM(members=["smollm2", "qwen2.5-coder"], temperature=0.2, segment_len=6)
    assert ChatSpecEM().member_names == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert ChatSpecEM(preset="fast").member_names == ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
    assert llm._identifying_params["members"] == ["smollm2", "qwen2.5-coder"]
    assert llm._identifying_params["segment_len"] == 6
    assert llm._llm_type == "specem-chat"


def test_engine_is_built_once_and_shared_between_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    import specem_core.registry as registry

    loads: list[str] = []

    def fake_load(spec: str, **kwargs: Any) -> FollowScript:
        loads.append(spec)
        time.sleep(0.05)  # widen the race window
        return FollowScript(spec, fixed("Hello."))

    monkeypatch.setattr(registry, "load_member", fake_load)
    llm = ChatSpecEM(members=["a", "b"], max_tokens=8)
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(str(llm.invoke("hi").content))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(loads) == ["a", "b"]
    assert answers == ["Hello."] * 6


def test_ls_params_and_model_override() -> None:
    llm = ChatSpecEM(model="fast", temperature=0.5, max_tokens=9, stop=["x"])
    params = llm._get_ls_params()
    assert params == {
        "ls_provider": "specem",
        "ls_model_name": "fast",
        "ls_model_type": "chat",
        "ls_temperature": 0.5,
        "ls_max_tokens": 9,
        "ls_stop": ["x"],
    }
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": -1}, ValidationError, "temperature"),
        ({"segment_len": 0}, ValidationError, "segment_len"),
        ({"engine_options": {"warp_speed": 9}}, ValidationError, "warp_speed"),
        ({"members": "smollm2"}, TypeError, "list"),
        ({"members": [3]}, TypeError, "member 0 is a int"),
        ({"members": [""]}, ValidationError, "empty"),
        ({"engine": object()}, TypeError, "SpecEM"),
    ],
)
def test_bad_construction(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ChatSpecEM(**kwargs)


# -- messages ----------------------------------------------------------------------------------
def test_message_conversion() -> None:
    msgs = to_engine_messages(
        [
            SystemMessage("Be brief."),
            HumanMessage([{"type": "text", "text": "What is "}, "magic(3)?"], name="ann"),
            AIMessage(
                [{"type": "text", "text": "Let me check."}, {"type": "tool_use", "id": "c1", "name": "m", "input": {}}],
                tool_calls=[{"name": "magic_function", "args": {"input": 3}, "id": "c1", "type": "tool_call"}],
            ),
            ToolMessage("5", tool_call_id="c1", name="magic_function"),
            ToolMessage("bad input", tool_call_id="c2", status="error"),
            ChatMessage(role="human", content="thanks"),
            FunctionMessage(name="legacy", content="7"),
        ]
    )
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is magic(3)?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "magic_function", "arguments": {"input": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5", "name": "magic_function"},
        {"role": "tool", "tool_call_id": "c2", "content": "Error: bad input"},
        {"role": "user", "content": "thanks"},
        {"role": "tool", "name": "legacy", "content": "7"},
    ]


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([], ValueError, "empty"),
        (
            [HumanMessage([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])],
            ValueError,
            "'image_url'",
        ),
        ([HumanMessage([{"type": "image", "base64": "AAAA", "mime_type": "image/png"}])], ValueError, "'image'"),
        ([ChatMessage(role="narrator", content="once upon a time")], ValueError, "narrator"),
        ([RemoveMessage(id="x")], TypeError, "RemoveMessage"),
        ([HumanMessage("   ")], ValueError, "empty"),
    ],
)
def test_bad_messages(messages: list[Any], error: type[Exception], match: str) -> None:
    llm = scripted(FollowScript("a", fixed("ok")))
    with pytest.raises(error, match=match):
        llm.invoke(messages)


def test_history_reaches_the_members() -> None:
    member = tool_or_text("unused")
    llm = scripted(member)
    history = [
        HumanMessage("magic_function(3)?"),
        AIMessage("", tool_calls=[{"name": "magic_function", "args": {"input": 3}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("5", tool_call_id="c1", name="magic_function"),
    ]
    answer = llm.bind_tools([magic_function]).invoke(history)
    assert answer.content == "The result is 5."
    request = member.requests[-1]
    assert [m["role"] for m in request.messages] == ["user", "assistant", "tool"]
    assert request.messages[2]["tool_call_id"] == "c1"
    assert [t["function"]["name"] for t in request.tools or []] == ["magic_function"]


# -- invoke / stream on tiny models ------------------------------------------------------------
class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_invoke_reports_usage_metadata_and_trace() -> None:
    msg = ChatSpecEM(engine=tiny_engine(), model="tiny-pair").invoke("Hello")
    assert isinstance(msg, AIMessage)
    assert msg.content
    assert msg.usage_metadata is not None
    assert msg.usage_metadata["output_tokens"] > 0
    usage = msg.usage_metadata
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = msg.response_metadata
    assert meta["model_name"] == "tiny-pair"
    assert meta["finish_reason"] in ("stop", "length")
    trace = meta["specem"]
    assert trace["members"] == ["llama", "qwen2"]
    assert trace["members_per_round"] == [2] * len(trace["segments"])
    segment = trace["segments"][0]
    assert set(segment) >= {"text", "winner", "combined", "weights", "candidates"}
    assert "".join(s["text"] for s in trace["segments"]) == msg.content


def test_stream_chunk_rules() -> None:
    llm = ChatSpecEM(engine=tiny_engine())
    handler = Tokens()
    chunks = list(llm.stream("Hello", config={"callbacks": [handler]}))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert [c.chunk_position for c in chunks] == [None] * (len(chunks) - 1) + ["last"]
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    assert sum("model_name" in c.response_metadata for c in chunks) == 1
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    invoked = llm.invoke("Hello")
    assert full.content == invoked.content  # greedy: streaming and invoke agree
    assert full.usage_metadata == invoked.usage_metadata
    segments = full.response_metadata["specem"]["segments"]
    # one chunk per committed segment, plus a closing chunk when the answer ran out of tokens
    assert len(chunks) == len(segments) + (full.response_metadata["finish_reason"] == "length")
    assert "".join(handler.tokens) == full.content


async def test_async_invoke_and_stream() -> None:
    llm = ChatSpecEM(engine=tiny_engine())
    msg = await llm.ainvoke("Hello")
    chunks = [c async for c in llm.astream("Hello")]
    assert chunks[-1].chunk_position == "last"
    assert "".join(str(c.content) for c in chunks) == msg.content
    results = await llm.abatch(["Hello", "Hi"])
    assert len(results) == 2


def test_streaming_field_and_stop_and_per_call_overrides() -> None:
    llm = scripted(FollowScript("a", fixed("Hello there, how are you today?")))
    assert llm.invoke("hi", stop=["how"]).content == "Hello there, "
    assert ChatSpecEM(engine=llm.engine, stop=["you"]).invoke("hi").content == "Hello there, how are "
    assert ChatSpecEM(engine=llm.engine, streaming=True, max_tokens=2).invoke("hi").content == "Hello th"
    assert llm.invoke("hi", max_tokens=1).response_metadata["finish_reason"] == "length"
    with pytest.raises(ValueError, match="ChatSpecEM call got an unknown option 'warp'"):
        llm.invoke("hi", warp=9)


def test_lcel_chain_and_batch_on_tiny_models() -> None:
    prompt = ChatPromptTemplate.from_messages([("system", "Answer briefly."), ("human", "{question}")])
    chain = prompt | ChatSpecEM(engine=tiny_engine()) | StrOutputParser()
    answers = chain.batch([{"question": "Capital of France?"}, {"question": "2+2?"}])
    assert all(isinstance(a, str) and a for a in answers)


class Slow(FollowScript):
    def open(self, request: Any) -> Any:
        session = super().open(request)
        original = session.draft

        def slow_draft(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.2)
            return original(*args, **kwargs)

        session.draft = slow_draft
        return session


def test_timeout() -> None:
    llm = scripted(Slow("slow", fixed("a long answer " * 20)))
    llm = ChatSpecEM(engine=llm.engine, timeout=0.3)
    with pytest.raises(TimeoutError, match=r"timeout=0\.3"):
        llm.invoke("hi")


async def test_async_timeout() -> None:
    llm = ChatSpecEM(engine=scripted(Slow("slow", fixed("a long answer " * 20))).engine, timeout=0.3)
    with pytest.raises(TimeoutError, match=r"timeout=0\.3"):
        await llm.ainvoke("hi")
    await asyncio.sleep(0.5)  # let the engine's worker see the cancellation while the loop is alive


# -- tools -------------------------------------------------------------------------------------
def test_tool_call_invoke_and_stream_agree() -> None:
    llm = scripted(tool_or_text("no tools"), FollowScript("talker", fixed("I think it is 5."), confidence=1.5))
    bound = llm.bind_tools([magic_function])
    msg = bound.invoke("magic_function(3)?")
    assert msg.content == ""
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("magic_function", {"input": 3})]
    assert msg.tool_calls[0]["id"].startswith("call_")
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(bound.stream("magic_function(3)?"))
    assert all(c.content == "" for c in chunks)  # no markup is streamed as text
    assert sum(bool(c.tool_call_chunks) for c in chunks) == 1
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("magic_function", {"input": 3})]
    assert any(b["type"] == "tool_call" for b in full.content_blocks)


def test_tool_choice_forces_a_call() -> None:
    prefill = '<tool_call>\n{"name": "get_weather", "arguments": {'  # committed before the first round
    member = FollowScript("a", lambda r: prefill + '"city": "Paris"}}' if r.tools else "x")
    llm = scripted(member)
    msg = llm.bind_tools([magic_function, get_weather], tool_choice="get_weather").invoke("Hello!")
    assert msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"] == {"city": "Paris"}


def test_tool_choice_none_hides_the_tools() -> None:
    member = FollowScript("a", lambda r: "tools!" if r.tools else "plain answer")
    msg = scripted(member).bind_tools([magic_function], tool_choice="none").invoke("hi")
    assert msg.content == "plain answer"
    assert msg.tool_calls == []


def test_invalid_tool_calls_do_not_raise() -> None:
    bad = '<tool_call>{"name": "magic_function", "arguments": {"input": "three"}}</tool_call>'
    msg = scripted(FollowScript("a", fixed(bad))).bind_tools([magic_function]).invoke("hi")
    assert msg.tool_calls == []
    assert msg.invalid_tool_calls[0]["name"] == "magic_function"
    assert "expected integer" in (msg.invalid_tool_calls[0]["error"] or "")


@pytest.mark.parametrize(
    ("tools", "kwargs", "match"),
    [
        ([magic_function], {"tool_choice": "sometimes"}, "unknown tool_choice"),
        ([magic_function], {"tool_choice": "get_weather"}, "unknown tool_choice 'get_weather'"),
        ([magic_function], {"tool_choice": {"type": "function", "function": {"name": "zz"}}}, "'zz'.*not among"),
        ([42], {}, "tool 0 .*cannot build a JSON schema"),
        ([magic_function, {"name": "magic_function", "parameters": {}}], {}, "repeated.*magic_function"),
        ([{"type": "function", "function": {"name": "x y"}}], {}, "invalid name"),
    ],
)
def test_bad_tools(tools: list[Any], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChatSpecEM().bind_tools(tools, **kwargs)


def test_agent_loop_with_create_agent_scripted() -> None:
    from langchain.agents import create_agent

    calls: list[int] = []

    @tool
    def magic(input: int) -> int:
        """Apply a magic function to an input."""
        calls.append(input)
        return input + 2

    def script(request: Any) -> str:
        if request.messages[-1]["role"] == "tool":
            return f"magic(3) is {request.messages[-1]['content']}."
        return '<tool_call>{"name": "magic", "arguments": {"input": 3}}</tool_call>'

    agent = create_agent(scripted(FollowScript("a", script)), tools=[magic])
    out = agent.invoke({"messages": [("user", "What is magic(3)?")]})
    assert calls == [3]
    assert out["messages"][-1].content == "magic(3) is 5."


# -- structured output -------------------------------------------------------------------------
class Joke(BaseModel):
    """Joke to tell user."""

    setup: str
    punchline: str


class JokeDict(TypedDict):
    """Joke to tell user."""

    setup: str
    punchline: str


JOKE = {"setup": "Why?", "punchline": "Because."}


def joke_member() -> FollowScript:
    import json

    def script(request: Any) -> str:
        body = json.dumps(JOKE)
        if request.tools:  # function calling: the call's start is prefilled up to the arguments
            return f'<tool_call>\n{{"name": "{request.tools[0]["function"]["name"]}", "arguments": {body}}}'
        return body  # json mode: "{" is prefilled

    return FollowScript("joker", script)


@pytest.mark.parametrize("method", ["function_calling", "json_mode", "json_schema"])
@pytest.mark.parametrize("schema", [Joke, JokeDict, Joke.model_json_schema()])
def test_with_structured_output(method: str, schema: Any) -> None:
    member = joke_member()
    chat = scripted(member).with_structured_output(schema, method=method)  # type: ignore[arg-type]
    result = chat.invoke("Tell me a joke")
    expected = Joke(**JOKE) if schema is Joke else JOKE
    assert result == expected
    streamed = list(chat.stream("Tell me a joke"))
    assert streamed[-1] == expected
    if method == "json_schema":
        assert "punchline" in member.requests[0].messages[0]["content"]  # the schema is described


def test_structured_output_include_raw_and_errors() -> None:
    chat = scripted(joke_member()).with_structured_output(Joke, include_raw=True)
    out = chat.invoke("joke")
    assert isinstance(out, dict)
    assert out["parsed"] == Joke(**JOKE)
    assert isinstance(out["raw"], AIMessage)
    assert out["parsing_error"] is None
    with pytest.raises(ValueError, match="unknown method"):
        ChatSpecEM().with_structured_output(Joke, method="xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a schema"):
        ChatSpecEM().with_structured_output(None)


def test_member_weights_path_reaches_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from scripted import ScriptedMember

    import specem_core.registry as registry
    from specem_core.weights import MemberWeights

    def fake_load(spec: str, **kwargs: Any) -> ScriptedMember:
        return ScriptedMember(
            spec, drafts=[(spec.upper() + " ", False)], scorer=lambda committed, c: 2.0 if "A" in c.text else 1.0
        )

    monkeypatch.setattr(registry, "load_member", fake_load)
    path = tmp_path / "weights.json"
    llm = ChatSpecEM(members=["a", "b", "c"], max_tokens=4, member_weights=str(path))
    llm.invoke("hi")
    weights = llm.get_engine().member_weights
    assert isinstance(weights, MemberWeights)
    assert weights.requests == 1
    assert path.exists()  # saved after the request
    assert ChatSpecEM(members=["a", "b"]).get_engine().member_weights is None  # opt-in


def test_a_follow_up_reports_the_tokens_read_from_the_prefix_cache() -> None:
    """``usage_metadata["input_token_details"]["cache_read"]``: prompt tokens the members read from
    their prefix caches (as langchain-openai maps OpenAI's ``cached_tokens``)."""
    import tiny

    model = ChatSpecEM(engine=SpecEM([tiny.member("llama", name="cache-a")], SpecEMConfig(max_new_tokens=6)))
    history: list[Any] = [SystemMessage("Be brief. " * 8), HumanMessage("Tell me about Paris.")]
    first = model.invoke(history)
    second = model.invoke([*history, first, HumanMessage("And Berlin?")])
    assert first.usage_metadata is not None
    assert second.usage_metadata is not None
    read = second.usage_metadata["input_token_details"]["cache_read"]
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0  # nothing cached yet
    assert 0 < read < second.usage_metadata["input_tokens"]
    per_member = second.response_metadata["specem"]["usage"]["per_member"]
    assert [u["cached_tokens"] for u in per_member] == [read]
