"""SpecEMLLM on scripted members (exact decisions) and tiny random models (real tokenizers)."""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ImageBlock, TextBlock, ToolCallBlock
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool
from scripted import ScriptedMember

from specem_core import ConfigError, InputError, SpecEM, SpecEMConfig
from specem_integrations.llamaindex import SpecEMLLM

ANSWER = [("The answer ", False), ("is ", False), ("42.", True)]


def scripted_engine(drafts: list[tuple[str, bool]] | None = None, **cfg: Any) -> SpecEM:
    a = ScriptedMember("alpha", drafts=drafts or ANSWER, context_window=4096)
    b = ScriptedMember("beta", drafts=[("Hmm", False), ("", True)], context_window=2048)
    return SpecEM([a, b], SpecEMConfig(**cfg))  # type: ignore[list-item]


def user(text: str = "What is six times seven?") -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def test_is_a_function_calling_llm_with_the_right_metadata() -> None:
    llm = SpecEMLLM(engine=scripted_engine(max_new_tokens=99))
    assert isinstance(llm, FunctionCallingLLM)
    meta = llm.metadata
    assert meta.context_window == 2048  # the smallest member's
    assert meta.num_output == 99
    assert meta.is_chat_model
    assert meta.is_function_calling_model
    assert meta.model_name == "specem:alpha+beta"
    meta = SpecEMLLM(engine=scripted_engine(), max_new_tokens=7, context_window=1000, model_name="ens").metadata
    assert (meta.context_window, meta.num_output, meta.model_name) == (1000, 7, "ens")
    assert SpecEMLLM.class_name() == "SpecEM_LLM"


def test_tiny_models_context_window_comes_from_the_engine(tiny_engine: SpecEM) -> None:
    llm = SpecEMLLM(engine=tiny_engine)
    assert llm.metadata.context_window == tiny_engine.context_window


def test_construction_is_lazy_and_the_engine_is_built_once_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []

    def build(self: SpecEMLLM) -> SpecEM:
        built.append(1)
        time.sleep(0.05)
        return scripted_engine()

    monkeypatch.setattr(SpecEMLLM, "_build_engine", build)
    llm = SpecEMLLM(members=["smollm2", "qwen2.5-coder"])
    assert not llm.engine_loaded
    assert built == []
    engines: list[Any] = []
    threads = [threading.Thread(target=lambda: engines.append(llm.engine)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1]
    assert len({id(e) for e in engines}) == 1
    assert llm.engine_loaded


def test_bad_construction() -> None:
    with pytest.raises(TypeError, match=r"engine must be a specem_core\.SpecEM"):
        SpecEMLLM(engine=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown option 'segment_length'; did you mean segment_len"):
        SpecEMLLM(engine=scripted_engine(), engine_options={"segment_length": 3})
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1, got 0"):
        SpecEMLLM(max_new_tokens=0)
    with pytest.raises(ValueError, match="timeout"):  # the fields that choose the ensemble keep their checks
        SpecEMLLM(timeout=-1)


def test_chat_returns_the_answer_and_the_trace() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    response = llm.chat(user())
    assert response.message.role == "assistant"
    assert response.message.content == "The answer is 42."
    trace = response.additional_kwargs
    assert trace["finish_reason"] == "stop"
    assert trace["completion_tokens"] > 0
    assert trace["total_tokens"] == trace["prompt_tokens"] + trace["completion_tokens"]
    assert [u["member"] for u in trace["usage"]["per_member"]] == ["alpha", "beta"]
    assert trace["members"] == ["alpha", "beta"]
    assert trace["members_per_round"] == [2] * len(trace["segments"])
    assert "".join(s["text"] for s in trace["segments"]) == "The answer is 42."
    first = trace["segments"][0]
    assert set(first) >= {"text", "winner", "combined", "weights", "candidates"}
    assert first["winner"] == "alpha"
    assert first["verifiers"] == ["alpha", "beta"]
    assert len(first["weights"]) == len(first["verifiers"])
    assert len(first["combined"]) == len(first["candidates"])
    assert response.raw["text"] == "The answer is 42."
    assert response.raw["segments"][0]["raw_scores"]  # the full trace: matrices, rewards, ...


def test_stream_chat_yields_cumulative_messages_and_real_deltas() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    gen = llm.stream_chat(user())
    assert inspect.isgenerator(gen)
    responses = list(gen)
    assert len(responses) == 3  # one per committed segment
    text = ""
    for r in responses:
        text += r.delta or ""
        assert r.message.content == text
    assert text == "The answer is 42."
    assert responses[0].additional_kwargs["segment"]["winner"] == "alpha"
    assert responses[-1].additional_kwargs["finish_reason"] == "stop"
    assert responses[-1].raw["text"] == text


def test_stop_strings_and_per_call_options() -> None:
    llm = SpecEMLLM(engine=scripted_engine(), stop=["is"])
    assert llm.chat(user()).message.content == "The answer "
    assert llm.chat(user(), stop=["42"]).message.content == "The answer is "
    assert "".join(r.delta or "" for r in llm.stream_chat(user(), stop=["42"])) == "The answer is "
    capped = SpecEMLLM(engine=scripted_engine([("w w w ", False)])).chat(user(), max_tokens=5)
    assert capped.additional_kwargs["finish_reason"] == "length"
    with pytest.raises(ConfigError, match=r"SpecEMLLM call got an unknown option 'bogus'"):
        llm.chat(user(), bogus=1)
    with pytest.raises(ConfigError, match="temperature"):
        llm.chat(user(), temperature=-1)


def test_completion_methods_derive_from_chat() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    done = llm.complete("Say it")
    assert done.text == "The answer is 42."
    assert done.additional_kwargs["finish_reason"] == "stop"
    pieces = list(llm.stream_complete("Say it"))
    assert [p.text for p in pieces][-1] == "The answer is 42."
    assert "".join(p.delta or "" for p in pieces) == "The answer is 42."


async def test_async_methods_match_sync() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    assert (await llm.achat(user())).message.content == "The answer is 42."
    gen = await llm.astream_chat(user())
    assert inspect.isasyncgen(gen)
    responses = [r async for r in gen]
    assert "".join(r.delta or "" for r in responses) == "The answer is 42."
    assert responses[-1].message.content == "The answer is 42."
    assert (await llm.acomplete("x")).text == "The answer is 42."
    agen = await llm.astream_complete("x")
    assert [c.text async for c in agen][-1] == "The answer is 42."


async def test_tiny_models_stream_and_chat_agree(tiny_engine: SpecEM) -> None:
    llm = SpecEMLLM(engine=tiny_engine)
    full = llm.chat(user("Hello"))
    streamed = list(llm.stream_chat(user("Hello")))
    assert streamed[-1].message.content == full.message.content
    assert "".join(r.delta or "" for r in streamed) == full.message.content
    agen = await llm.astream_chat(user("Hello"))
    assert [r async for r in agen][-1].message.content == full.message.content
    assert full.additional_kwargs["completion_tokens"] <= 12 + 4


def test_bad_input_raises_before_any_work() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    with pytest.raises(InputError, match="messages is empty"):
        llm.chat([])
    with pytest.raises(InputError, match="messages is empty"):
        llm.stream_chat([])  # raised at the call, not at the first next()
    with pytest.raises(InputError, match="ImageBlock"):
        llm.chat([ChatMessage(role="user", blocks=[TextBlock(text="see"), ImageBlock(image=b"x")])])
    # LlamaIndex's callback layer validates dict messages first: still a ValueError naming the role.
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "oracle", "content": "x"}])  # type: ignore[list-item]
    odd = ChatMessage.model_construct(role="oracle", blocks=[TextBlock(text="x")], additional_kwargs={})
    with pytest.raises(InputError, match="message 0 has unknown role 'oracle'"):
        llm.chat([odd])
    with pytest.raises(InputError, match="every message has empty content"):
        llm.chat([ChatMessage(role="user", content="")])


async def test_bad_input_raises_in_async_calls_too() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    with pytest.raises(InputError, match="messages is empty"):
        await llm.achat([])
    with pytest.raises(InputError, match="messages is empty"):
        await llm.astream_chat([])
    with pytest.raises(InputError, match="every message has empty content"):
        await llm.astream_chat([ChatMessage(role="user", content="  ")])


def test_prepare_chat_with_tools_copies_the_history() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    history = [ChatMessage(role="system", content="Be brief.")]
    kwargs = llm._prepare_chat_with_tools([FunctionTool.from_defaults(multiply)], "6*7?", chat_history=history)
    assert len(history) == 1  # never mutated
    assert [m.role.value for m in kwargs["messages"]] == ["system", "user"]
    assert kwargs["tools"][0]["function"]["name"] == "multiply"
    assert "tool_choice" not in kwargs
    forced = llm._prepare_chat_with_tools([multiply], "x", tool_required=True, tool_choice="multiply")
    assert forced["tool_choice"] == "multiply"
    assert forced["tool_required"] is True
    with pytest.raises(InputError, match="not one of the tools"):
        llm._prepare_chat_with_tools([multiply], "x", tool_choice="divide")


def tool_response(*calls: ToolCallBlock, text: str = "") -> ChatResponse:
    return ChatResponse(message=ChatMessage(role="assistant", blocks=[TextBlock(text=text), *calls]))


def test_tool_calls_are_read_from_tool_call_blocks() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    response = tool_response(
        ToolCallBlock(tool_call_id="call_a", tool_name="multiply", tool_kwargs={"a": 6, "b": 7}),
        ToolCallBlock(tool_name="multiply", tool_kwargs='{"a": 2, "b": 3}'),
    )
    selections = llm.get_tool_calls_from_response(response)
    first = selections[0]
    assert (first.tool_id, first.tool_name, first.tool_kwargs) == ("call_a", "multiply", {"a": 6, "b": 7})
    assert selections[1].tool_kwargs == {"a": 2, "b": 3}
    assert selections[1].tool_id.startswith("call_")
    assert llm.get_tool_calls_from_response(tool_response(text="hi"), error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(tool_response(text="hi"))


def test_validate_keeps_one_call_unless_parallel_calls_are_allowed() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    response = tool_response(
        ToolCallBlock(tool_call_id="1", tool_name="multiply", tool_kwargs={"a": 1, "b": 2}),
        ToolCallBlock(tool_call_id="2", tool_name="multiply", tool_kwargs={"a": 3, "b": 4}),
        text="calling",
    )
    single = llm._validate_chat_with_tools_response(response, [], allow_parallel_tool_calls=False)
    assert [s.tool_id for s in llm.get_tool_calls_from_response(single)] == ["1"]
    assert single.message.content == "calling"
    assert len(llm.get_tool_calls_from_response(response)) == 2  # the original is untouched
    both = llm._validate_chat_with_tools_response(response, [], allow_parallel_tool_calls=True)
    assert len(llm.get_tool_calls_from_response(both)) == 2


def test_tool_choice_without_tools_is_an_error() -> None:
    llm = SpecEMLLM(engine=scripted_engine())
    with pytest.raises(InputError, match="without any tools"):
        llm.chat(user(), tool_choice="multiply")


def test_serializes_without_the_engine() -> None:
    llm = SpecEMLLM(engine=scripted_engine(), max_new_tokens=8)
    data = llm.to_dict()
    assert data["class_name"] == "SpecEM_LLM"
    assert data["max_tokens"] == 8
    assert "engine" not in data
    assert SpecEMLLM(preset="fast", top_p=0.5).to_dict()["preset"] == "fast"


def test_parity_with_chat_specem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Member objects, member_kwargs, a preset, and the sampling fields all reach the engine."""
    import specem_core.registry as registry

    loaded: list[tuple[str, dict[str, Any]]] = []

    def fake_load(spec: str, **kwargs: Any) -> ScriptedMember:
        loaded.append((spec, kwargs))
        return ScriptedMember(spec, drafts=[("Hi.", True)])

    monkeypatch.setattr(registry, "load_member", fake_load)
    own = ScriptedMember("mine", drafts=[("Hi.", True)])
    llm = SpecEMLLM(preset="fast", members=[own, "other"], member_kwargs={"n_ctx": 512}, backend="llamacpp", seed=4)
    assert [m.name for m in llm.engine.members] == ["mine", "other"]
    assert loaded == [("other", {"backend": "llamacpp", "device": None, "n_ctx": 512})]
    assert llm.engine.config.trusted_opening_rounds == 2  # the preset's settings
    assert llm._config_overrides({})["seed"] == 4
    loaded.clear()
    preset_llm = SpecEMLLM(model="fast")
    assert [m.name for m in preset_llm.engine.members] == ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
    assert preset_llm.engine.member_weights is not None
    with pytest.raises(ConfigError, match="takes no preset= or members="):
        SpecEMLLM(engine=scripted_engine(), preset="fast")
    with pytest.raises(ConfigError, match="disagree"):
        SpecEMLLM(model="fast", preset="quality")
    with pytest.raises(ConfigError, match="member 0 is a int"):
        SpecEMLLM(members=[3])


def test_member_weights_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from scripted import ScriptedMember

    import specem_core.registry as registry
    from specem_core.weights import MemberWeights

    def fake_load(spec: str, **kwargs: Any) -> ScriptedMember:
        return ScriptedMember(
            spec, drafts=[(spec.upper() + " ", False)], scorer=lambda committed, c: 2.0 if "A" in c.text else 1.0
        )

    monkeypatch.setattr(registry, "load_member", fake_load)
    weights = MemberWeights({"a": 2.0})
    llm = SpecEMLLM(members=["a", "b", "c"], max_new_tokens=4, member_weights=weights)
    llm.complete("hi")
    assert llm.engine.member_weights is weights
    assert weights.requests == 1


def test_a_follow_up_reports_the_tokens_read_from_the_prefix_cache() -> None:
    """The raw result's usage says how many prompt tokens each member read from its prefix cache."""
    import tiny

    llm = SpecEMLLM(engine=SpecEM([tiny.member("qwen2", name="cache-b")], SpecEMConfig(max_new_tokens=6)))
    history = [ChatMessage(role="system", content="Be brief. " * 8), ChatMessage(role="user", content="Hi there.")]
    first = llm.chat(history)
    second = llm.chat([*history, first.message, ChatMessage(role="user", content="And then?")])
    assert first.raw["usage"]["cached_tokens"] == 0
    usage = second.raw["usage"]
    assert 0 < usage["cached_tokens"] < usage["prompt_tokens"]
    assert usage["per_member"][0]["cached_tokens"] == usage["cached_tokens"]
