"""``specem serve`` through the official ``openai`` SDK and raw HTTP: answers, streaming, tools,
JSON output, multi-turn conversations, the opt-in trace (a real server process, SmolLM2)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from serve_process import ServeProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client(open_server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=open_server.base_url, api_key="not-checked", max_retries=0, timeout=120)


def _post(server: ServeProcess, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    merged = {**server.headers(), **(headers or {})}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120, headers=merged)


def _sse(response: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_and_health(open_server: ServeProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["specem"]
    assert client.models.retrieve("specem").id == "specem"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"
    health = open_server.health()
    assert health["status"] == "ok"
    assert health["members"] == ["smollm2-135m-instruct"]
    assert (health["max_concurrency"], health["queue"]) == (2, 4)


def test_answer_and_usage(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="specem", messages=QUESTION, max_tokens=8)
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == "specem"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert 0 < completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert "specem" not in (completion.model_extra or {})  # the trace is opt-in


def test_a_follow_up_reports_cached_tokens(client: openai.OpenAI) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: the conversation so far is read from the
    members' prefix caches (OpenAI's field; the members' sum)."""
    history: list[Any] = [
        {"role": "system", "content": "You answer in a few words. " * 6},
        {"role": "user", "content": "What colour is the sky?"},
    ]
    first = client.chat.completions.create(model="specem", messages=history, max_tokens=6)
    assert first.usage is not None
    assert first.usage.prompt_tokens_details is not None
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And grass?"},
    ]
    second = client.chat.completions.create(model="specem", messages=history, max_tokens=6)
    assert second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert first.usage.prompt_tokens_details.cached_tokens < cached < second.usage.prompt_tokens


def test_stream_equals_answer_and_reports_usage(client: openai.OpenAI) -> None:
    """Greedy: the streamed segments add up to the non-streamed answer."""
    kwargs: dict[str, Any] = {"model": "specem", "messages": QUESTION, "max_completion_tokens": 12}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_stop_and_seeded_sampling(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(model="specem", messages=QUESTION, max_tokens=16).choices[0].message.content
    assert base
    assert " " in base.strip()
    word = base.strip().split()[1]
    cut = client.chat.completions.create(model="specem", messages=QUESTION, max_tokens=16, stop=[word])
    assert cut.choices[0].message.content == base[: base.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    sampled = [
        client.chat.completions.create(
            model="specem", messages=QUESTION, max_tokens=10, temperature=0.9, top_p=0.95, seed=7
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_forced_tool_call(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    completion = client.chat.completions.create(
        model="specem",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=24,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}

    # the same request streamed: OpenAI's tool-call deltas (id + name, then the arguments)
    chunks = list(
        client.chat.completions.create(
            model="specem",
            messages=messages,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=24,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id
    assert deltas[0].function
    assert deltas[0].function.name == "get_weather"
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert arguments == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_multi_turn_with_tool_results(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 degrees"},
    ]
    completion = client.chat.completions.create(model="specem", messages=messages, tools=[WEATHER], max_tokens=48)
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length")  # the call was answered: a plain answer, no repeat
    assert choice.message.content
    assert not choice.message.tool_calls
    # list-of-parts content and a developer message are accepted too
    parts: Any = [
        {"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    assert client.chat.completions.create(model="specem", messages=parts, max_tokens=6).choices[0].message.content


def test_response_format_json(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    completion = client.chat.completions.create(
        model="specem",
        messages=[
            {
                "role": "user",
                "content": "The Eiffel Tower is in Paris, France. Reply in JSON with the city and the country.",
            }
        ],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        max_tokens=32,
    )
    assert completion.choices[0].finish_reason == "stop"
    value = json.loads(completion.choices[0].message.content or "")
    assert set(value) == {"city", "country"}  # parses, with exactly the required keys
    # (the value types: test_json_schema_types_end_to_end)
    obj = client.chat.completions.create(
        model="specem",
        messages=[{"role": "user", "content": "Give a JSON object with a key 'city'."}],
        response_format={"type": "json_object"},
        max_tokens=24,
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def _validate(value: Any, schema: dict[str, Any]) -> None:
    """``value`` fits ``schema``: with ``jsonschema`` when it is installed, else by hand (the
    keywords these tests use: type, properties, required, items, enum, additionalProperties)."""
    try:
        import jsonschema
    except ImportError:
        _check_by_hand(value, schema, "$")
    else:
        jsonschema.validate(value, schema)


def _check_by_hand(value: Any, schema: dict[str, Any], where: str) -> None:
    kinds = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": (int, float),
    }
    kind = schema.get("type")
    if kind is not None:
        assert isinstance(value, kinds[kind]), f"{where}: {value!r} is not {kind}"
        if kind in ("integer", "number"):
            assert not isinstance(value, bool), f"{where}: {value!r} is a boolean, not {kind}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value), f"{where}: missing {schema.get('required')}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{where}: unexpected keys {sorted(set(value) - set(props))}"
        for key, sub in props.items():
            if key in value:
                _check_by_hand(value[key], sub, f"{where}.{key}")
    if kind == "array" and "items" in schema:
        for n, item in enumerate(value):
            _check_by_hand(item, schema["items"], f"{where}[{n}]")


def test_json_schema_types_end_to_end(client: openai.OpenAI) -> None:
    """A schema with an integer, a number, a boolean, an array, an enum and a nested object, all
    required: the served answer parses and fits it (each type as written, not a string for it)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "population_millions": {"type": "number"},
            "founded": {"type": "integer"},
            "is_capital": {"type": "boolean"},
            # maxItems: the small test member would otherwise list landmarks until the token cap
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "size": {"type": "string", "enum": ["small", "medium", "large"]},
            "country": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "code": {"type": "string"}},
                "required": ["name", "code"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "population_millions", "founded", "is_capital", "landmarks", "size", "country"],
        "additionalProperties": False,
    }
    completion = client.chat.completions.create(
        model="specem",
        messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        max_tokens=160,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content or "")
    _validate(value, schema)
    _check_by_hand(value, schema, "$")  # both ways: the hand check is what runs without jsonschema
    assert set(value) == set(schema["required"])


def test_trace_only_when_asked(open_server: ServeProcess) -> None:
    plain = _post(open_server, {"model": "specem", "messages": QUESTION, "max_tokens": 6}).json()
    assert "specem" not in plain
    traced = _post(open_server, {"model": "specem", "messages": QUESTION, "max_tokens": 6, "specem": {"trace": True}})
    trace = traced.json()["specem"]
    assert trace["members"] == ["smollm2-135m-instruct"]
    assert trace["segments"][0]["winner"] == "smollm2-135m-instruct"
    assert "".join(s["text"] for s in trace["segments"]) == traced.json()["choices"][0]["message"]["content"]

    stream = _post(
        open_server,
        {"model": "specem", "messages": QUESTION, "max_tokens": 6, "stream": True},
        headers={"X-SpecEM-Trace": "1"},
    )
    events = _sse(stream)
    assert events[-1] == "[DONE]"
    content_chunks = [e for e in events[:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content_chunks
    assert all("specem" in e for e in content_chunks)
    assert "segments" in events[-2]["specem"]  # the final chunk carries the whole trace
    untraced = _sse(_post(open_server, {"model": "specem", "messages": QUESTION, "max_tokens": 6, "stream": True}))
    assert all("specem" not in e for e in untraced[:-1])
    assert stream.headers["content-type"].startswith("text/event-stream")
