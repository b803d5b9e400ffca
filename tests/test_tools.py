"""Tool schemas, tool-call parsing, the JSON-prefix constraint and tool streaming (no models)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from specem_core.errors import InputError
from specem_core.tools import (
    ContentStream,
    JSONConstraint,
    OutputPlan,
    ToolCallConstraint,
    ToolChoice,
    call_in_progress,
    coerce_arguments,
    loads_lenient,
    normalize_tool_choice,
    normalize_tools,
    opens_call,
    opens_tool_listing,
    parse_tool_calls,
    visible_content,
)
from specem_core.tools.json_prefix import JSONPrefixParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
MAGIC = {
    "name": "magic_function",
    "description": "Apply a magic function to an input.",
    "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
}
NO_ARGS = {"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": {}}}
TOOLS = normalize_tools([WEATHER, MAGIC, NO_ARGS])


# -- schemas ---------------------------------------------------------------------------------
def test_normalize_accepts_both_shapes():
    assert [t["function"]["name"] for t in TOOLS] == ["get_weather", "magic_function", "ping"]
    assert all(t["type"] == "function" for t in TOOLS)
    assert TOOLS[2]["function"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        ({"type": "function", "function": {"name": "bad name!"}}, "invalid name"),
        ({"name": ""}, "invalid name"),
        ({"name": "x", "parameters": {"type": "string"}}, "'x'.*type 'object'"),
        ({"name": "x", "parameters": "nope"}, "'x'.*JSON-schema object"),
        ({"name": "x", "parameters": {"type": "object", "properties": {"a": 1}}}, "'x'.*properties"),
        ({"name": "x", "parameters": {"type": "object", "required": "a"}}, "'x'.*required"),
        ({"name": "x", "parameters": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}, "'x'.*b"),
        ({"type": "retrieval", "function": {"name": "x"}}, "only 'function'"),
        ("get_weather", "schema dict"),
    ],
)
def test_bad_schemas_name_the_tool(tool, message):
    with pytest.raises(InputError, match=message):
        normalize_tools([tool])


def test_duplicate_tool_names():
    assert normalize_tools([MAGIC, {**MAGIC, "parameters": {**MAGIC["parameters"], "title": "M"}}]) == normalize_tools(
        [MAGIC]
    )
    other = {**MAGIC, "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(InputError, match="different parameters: magic_function"):
        normalize_tools([MAGIC, other])


def test_tools_must_be_a_list():
    with pytest.raises(InputError, match="list"):
        normalize_tools(MAGIC)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, ToolChoice("auto")),
        ("auto", ToolChoice("auto")),
        ("none", ToolChoice("none")),
        ("any", ToolChoice("required")),
        ("required", ToolChoice("required")),
        (True, ToolChoice("required")),
        ("magic_function", ToolChoice("required", "magic_function")),
        ({"type": "function", "function": {"name": "ping"}}, ToolChoice("required", "ping")),
        ({"type": "tool", "name": "ping"}, ToolChoice("required", "ping")),
        ({"type": "any"}, ToolChoice("required")),
    ],
)
def test_tool_choice_shapes(choice, expected):
    assert normalize_tool_choice(choice, TOOLS) == expected


@pytest.mark.parametrize("choice", ["sometimes", "unknown_tool", {"type": "function", "function": {"name": "zz"}}, 3])
def test_unknown_tool_choice(choice):
    with pytest.raises(InputError, match="tool_choice"):
        normalize_tool_choice(choice, TOOLS)


# -- coercion --------------------------------------------------------------------------------
def test_coercion_follows_the_schema():
    params = TOOLS[0]["function"]["parameters"]
    assert coerce_arguments({"city": "Paris", "days": "3"}, params) == {"city": "Paris", "days": 3}
    assert coerce_arguments({"city": 75001, "days": 2.0}, params) == {"city": "75001", "days": 2}
    with pytest.raises(ValueError, match="missing required 'city'"):
        coerce_arguments({"days": 1}, params)
    with pytest.raises(ValueError, match="not one of"):
        coerce_arguments({"city": "Paris", "unit": "kelvin"}, params)
    with pytest.raises(ValueError, match="unknown property 'country'"):
        coerce_arguments({"city": "Paris", "country": "FR"}, params)
    with pytest.raises(ValueError, match="expected integer"):
        coerce_arguments({"city": "Paris", "days": "three"}, params)


def test_coercion_refs_unions_and_nesting():
    params = {
        "type": "object",
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "properties": {
            "p": {"$ref": "#/$defs/Point"},
            "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "flags": {"type": "array", "items": {"type": "boolean"}},
        },
    }
    out = coerce_arguments({"p": {"x": "1.5"}, "maybe": None, "flags": ["true", False]}, params)
    assert out == {"p": {"x": 1.5}, "maybe": None, "flags": [True, False]}
    assert coerce_arguments({"maybe": "4"}, params) == {"maybe": 4}
    assert coerce_arguments({"p": '{"x": 2}'}, params) == {"p": {"x": 2}}


# -- parsing ---------------------------------------------------------------------------------
def test_parse_canonical_call():
    text = 'Let me check.\n<tool_call>\n{"name": "magic_function", "arguments": {"input": "3"}}\n</tool_call>'
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == "Let me check."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("magic_function", {"input": 3})]
    assert parsed.tool_calls[0].id.startswith("call_")
    assert parsed.invalid_tool_calls == []


def test_parse_several_calls_unique_ids_and_unclosed_last_call():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert [c.arguments["city"] for c in parsed.tool_calls] == ["Paris", "Oslo"]
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert parsed.content == ""


def test_parse_repairs_truncated_json():
    parsed = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', TOOLS)
    assert parsed.tool_calls[0].arguments == {"city": "Par"}


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "magic_function", "arguments": {"input": 3}}',
        '  ```json\n{"name": "magic_function", "parameters": {"input": 3}}\n```',
        '[{"name": "magic_function", "arguments": {"input": 3}}]',
        '{"function": {"name": "magic_function", "arguments": "{\\"input\\": 3}"}}',
        # braces doubled as in a str.format prompt (issue 45's final answer on the quality preset)
        '{{"name": "magic_function", "arguments": {"input": 3}}',
        '{{"name": "magic_function", "arguments": {{"input": 3}}}}',
    ],
)
def test_parse_bare_json_calls(text):
    parsed = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("magic_function", {"input": 3})]
    assert parsed.content == ""


@pytest.mark.parametrize(
    ("text", "in_call"),
    [
        ("", False),
        ("The weather is fine.", False),
        ("Let me check. <tool_call>", True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', True),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', False),  # closed: what follows is not in it
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"na', True),
        ('{"name": "get_weather", "arguments": {"city": "Paris"', True),
        ('  {"name": "get_weather", "arguments": {"city": "a}b"}', True),  # a brace inside a string
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', False),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', False),
        ('[{"name": "a", "arguments": {}}, {"name": "b"', True),
        ("```json", True),  # a fence naming json, before its first line
        ('```json\n{\n  "name": "calculate_distance",\n  "arguments": {\n    "coord1": [33.44', True),
        ('```\n{"name": "a", "arguments": {"x": "\\"q\\""', True),  # an escaped quote
        ('```json\n{"name": "a", "arguments": {}}\n```', False),
        ("```", False),  # which fence, not known yet
        ("```python\nprint({'a': 1", False),  # code, not a call
        ("Use {braces} like this", False),  # only an answer that starts as JSON
    ],
)
def test_call_in_progress_tells_whether_the_answer_ends_inside_a_started_call(text, in_call):
    assert call_in_progress(text) is in_call


def test_plain_json_answer_is_not_a_call():
    parsed = parse_tool_calls('{"answer": 42}', TOOLS)
    assert parsed.tool_calls == []
    assert parsed.invalid_tool_calls == []
    assert parsed.content == '{"answer": 42}'


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "nope", "arguments": {}}', "unknown tool 'nope'"),
        ('{"arguments": {"input": 3}}', "no tool name"),
        ('{"name": "magic_function", "arguments": {"input": "x"}}', "expected integer"),
        ('{"name": "magic_function", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "magic_function", "arguments": {}}', "missing required 'input'"),
        ("not json at all", "no JSON"),
    ],
)
def test_invalid_calls_never_raise(body, error):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
    assert parsed.tool_calls == []
    assert len(parsed.invalid_tool_calls) == 1
    bad = parsed.invalid_tool_calls[0]
    assert error in bad.error
    assert bad.id.startswith("call_")


def test_no_tools_means_no_name_check():
    parsed = parse_tool_calls('<tool_call>{"name": "anything", "arguments": {"a": 1}}</tool_call>')
    assert parsed.tool_calls[0].name == "anything"


def test_loads_lenient():
    assert loads_lenient('```json\n{"a": [1, 2\n```') == {"a": [1, 2]}
    assert loads_lenient('{"a": 1} trailing words') == {"a": 1}
    assert loads_lenient('{"a": "b",') == {"a": "b"}
    with pytest.raises(ValueError, match="JSON"):
        loads_lenient("plain words")


# -- the constraint --------------------------------------------------------------------------
CANONICAL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def test_every_prefix_of_a_valid_call_is_accepted():
    c = ToolCallConstraint(TOOLS)
    text = "Sure. " + CANONICAL
    for n in range(len(text) + 1):
        assert c.accepts(text[:n]), text[:n]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"nam": 1',  # unknown key
        '<tool_call>{"name": "get_wx',  # not a tool name
        '<tool_call>{"name": "get_weather", "arguments": {"town"',  # unknown property
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}, "arguments"',  # repeated
        '<tool_call>{"name": "get_weather", "arguments": {}',  # closes before required city
        '<tool_call>{"name": "get_weather", "arguments": {"city": {"a"',  # object for a string
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P", "unit": "kel',  # enum
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P", "days": [1',  # array for int
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}} oops',  # junk after call
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call> then more',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P"<tool_call>',  # nested open
        '<tool_call>{"name": "magic_function"}',  # closes without its required arguments
        "<tool_call>Sure, I will call it",  # prose inside the call
        '<tool_call>{"name": "get_weather", "arguments": {"city": "P", "days": 01',  # bad number
    ],
)
def test_broken_calls_are_rejected(text):
    assert not ToolCallConstraint(TOOLS).accepts(text)


def test_lenient_values_that_coerce_are_accepted():
    c = ToolCallConstraint(TOOLS)
    assert c.accepts('<tool_call>{"name": "get_weather", "arguments": {"city": 75001, "days": "2"}}</tool_call>')
    assert c.accepts('<tool_call>{"arguments": {"input": 3}, "name": "magic_function"}</tool_call>')
    assert c.accepts('<tool_call>{"name": "ping"}</tool_call>')
    assert c.accepts('<tool_call>{"name": "magic_function", "arguments": "{\\"input\\": 3}"}')


def test_parallel_calls_and_text_between_them():
    parallel = ToolCallConstraint(TOOLS)
    two = CANONICAL + "\n" + CANONICAL
    assert parallel.accepts(two)
    assert parallel.accepts(CANONICAL + "\n<tool_")
    assert not parallel.accepts(CANONICAL + "\nThe weather is")
    single = ToolCallConstraint(TOOLS, single_call=True)
    assert single.accepts(CANONICAL + "\nanything: the request stops at the close tag")


def test_constraint_is_a_candidate_filter_that_looks_only_at_new_text():
    c = ToolCallConstraint(TOOLS)
    committed = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert c(committed, 'ty": "Paris"}}\n</tool_call>')
    assert not c(committed, 'ty": {"x": 1}}}')
    assert c("Free text { not json ", "at all } before any call")
    # a committed broken call (kept when every candidate was rejected) does not block text after it
    broken = '<tool_call>{"name": "nope"}</tool_call>'
    assert not c("", broken)
    assert c(broken, "")


def test_trim_cuts_to_the_longest_valid_prefix():
    c = ToolCallConstraint(TOOLS)
    committed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'
    assert c.trim(committed, ', "town": "x"}}') == ', "'  # a key may still start
    assert c.trim(committed, "}}\n</tool_call>") == "}}\n</tool_call>"


def test_json_constraint():
    schema = {
        "type": "object",
        "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
        "required": ["setup", "punchline"],
    }
    c = JSONConstraint(schema)
    good = '{"setup": "Why?", "punchline": "Because."}'
    for n in range(len(good) + 1):
        assert c.accepts(good[:n])
    assert c.accepts(good + "\n")
    assert not c.accepts('{"setup": "Why?"}')
    assert not c.accepts('{"joke": ')
    assert not c.accepts(good + " more")
    assert JSONConstraint().accepts('{"anything": [1, {"b": null}]}')
    assert c.trim("{", '"setup": "a", "x": 1}') == '"setup": "a", "'


def test_json_answer_whitespace_is_llama_cpp_grammar_space():
    """Between two tokens of a JSON answer: nothing, one space, or one or two line ends and up to
    20 of indent (llama.cpp's JSON grammars' ``space``), so a small model cannot pad the answer
    with blank lines until the token cap; a string's content and the text after a complete answer
    are free, and tool calls (parsed loosely) keep any whitespace."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
    c = JSONConstraint(schema)
    assert c.accepts('{\n  "n": 1,\n\n\t"s": "a  \n\n\n  b"\n}')
    assert c.accepts("\n{")  # leading: the same rule
    assert c.accepts('{"n":' + "\n" + " " * 20)
    assert c.accepts('{"n": 1}\n\n\n   ')
    assert c.accepts('{"n":\r')  # a prefix of \r\n
    assert not c.accepts('{"n":' + "\n" + " " * 21)
    assert not c.accepts('{"n":  1')
    assert not c.accepts('{"n":\n\n\n1')
    assert not c.accepts("{ \n")
    # a candidate of blank lines is cut back to what the rule allows, then the listed options
    assert c.trim('{"n":', "\n \n \n 7}") == "\n "
    assert c.trim('{"n": ', "\n 7}") == ""  # the space already written counts
    assert c.options('{"n":\n ') == ["-", *"0123456789"]
    loose = JSONPrefixParser('{"name": "f",\n\n\n   "arguments": {}}')
    loose.value()
    assert loose.i == len(loose.s)


def test_json_object_answer_takes_keys_after_a_comma_and_space():
    """``{"type": "json_object"}`` and open objects: the next key after ``", "`` (was rejected, so
    every two-key answer fell back to an unchecked vote)."""
    for c in (JSONConstraint(), JSONConstraint({"type": "object", "additionalProperties": True})):
        assert c.complete('{"a": 1, "b": [2, 3],\n  "c": {"d": null}}')
        assert c.accepts('{"a": 1, ')
        assert not c.accepts('{"a": 1, 2')


def test_json_constraint_keeps_the_schema_types_as_written():
    """A JSON answer is returned as is: no number in a string field, no string in a number field
    (tool arguments, by contrast, are coerced after parsing; see below)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "height": {"type": "number"},
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
        },
    }
    c = JSONConstraint(schema)
    assert c.accepts('{"name": "Ada", "age": 36, "height": 1.65, "ok": true, "note": null}')
    assert not c.accepts('{"name": 5')  # was accepted before: a number in a string field
    assert not c.accepts('{"name": true')
    assert not c.accepts('{"age": "36"')
    assert not c.accepts('{"age": 36.5')  # an integer has no fraction
    assert not c.accepts('{"age": 1e3')
    assert c.accepts('{"height": -2.5e-1')
    assert not c.accepts('{"ok": "yes"')
    assert not c.accepts('{"note": 3')
    assert c.accepts('{"note": "n')
    assert c.trim('{"name": ', '42, "age": 1}') == ""
    assert c.options('{"ok": ') == ["true", "false"]


def test_tool_arguments_stay_coercible() -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}},
        },
    }
    c = ToolCallConstraint([tool])
    assert c.accepts('<tool_call>\n{"name": "f", "arguments": {"n": "3", "s": 4}}</tool_call>')


# -- streaming -------------------------------------------------------------------------------
def test_visible_content_holds_back_markup():
    assert visible_content("Hello <tool_c") == "Hello"
    assert visible_content("Hello <tool_call>{") == "Hello"
    assert visible_content("A <tool_call>{}</tool_call> B") == "A  B"
    assert visible_content('  {"name": "x"') == ""
    assert visible_content("```py") == "```py"
    assert visible_content("``") == ""
    assert visible_content("a < b") == "a < b"


def test_content_stream_matches_the_parsed_content():
    text = "Sure thing. <tool_call>\n" + '{"name": "ping"}\n</tool_call>\n'
    stream = ContentStream()
    deltas = [stream.feed(text[:n]) for n in range(len(text) + 1)]
    parsed = parse_tool_calls(text, TOOLS)
    deltas.append(stream.finish(parsed.content))
    assert "".join(deltas) == parsed.content == "Sure thing."


def test_content_stream_without_calls_keeps_all_text():
    text = "  Hello,\nworld!  "
    stream = ContentStream()
    deltas = [stream.feed(text[:n]) for n in range(len(text) + 1)]
    parsed = parse_tool_calls(text, TOOLS)
    deltas.append(stream.finish(parsed.content))
    assert "".join(deltas) == parsed.content == "Hello,\nworld!  "


# -- the plan --------------------------------------------------------------------------------
def test_plan_forcing_and_errors():
    assert OutputPlan.build(None) is None
    assert OutputPlan.build([]) is None
    auto = OutputPlan.build([MAGIC])
    assert auto is not None
    assert auto.prefill == ""
    assert auto.parse
    assert auto.stop == ("</tool_call>",)
    assert OutputPlan.build([MAGIC], parallel_tool_calls=True).stop == ()  # type: ignore[union-attr]
    anyone = OutputPlan.build([MAGIC, WEATHER], "any")
    assert anyone is not None
    assert anyone.prefill == '<tool_call>\n{"name": "'
    assert anyone.choices == ('magic_function", "arguments": {', 'get_weather", "arguments": {')
    single = OutputPlan.build([MAGIC], "any")
    assert single is not None
    assert single.prefill == '<tool_call>\n{"name": "magic_function", "arguments": {'
    assert single.choices == ()
    named = OutputPlan.build([MAGIC, WEATHER], "get_weather")
    assert named is not None
    assert named.prefill.endswith('"get_weather", "arguments": {')
    none = OutputPlan.build([MAGIC], "none")
    assert none is not None
    assert none.tools == []
    assert not none.parse
    with pytest.raises(InputError, match="without tools"):
        OutputPlan.build(None, "any")
    with pytest.raises(InputError, match="unknown tool_choice"):
        OutputPlan.build([MAGIC], "sometimes")


def test_plan_json_output():
    plan = OutputPlan.build(response_format={"type": "json_object"})
    assert plan is not None
    assert plan.prefill == "{"
    assert not plan.parse
    msgs = plan.prepare_messages([{"role": "user", "content": "hi"}])
    assert msgs[0]["role"] == "system"
    assert "JSON" in msgs[0]["content"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    plan = OutputPlan.build(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert plan is not None
    assert json.dumps(schema) in (plan.instruction or "")
    with pytest.raises(InputError, match="response_format"):
        OutputPlan.build(response_format={"type": "xml"})
    with pytest.raises(InputError, match="not both"):
        OutputPlan.build([MAGIC], response_format={"type": "json_object"})


def test_strings_standing_for_numbers_or_booleans_must_look_like_them():
    c = ToolCallConstraint(TOOLS)
    head = '<tool_call>{"name": "get_weather", "arguments": {"city": "P", "days": '
    assert c.accepts(head + '"12"}}')
    assert not c.accepts(head + '"twelve')
    flag = normalize_tools([{"name": "f", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}}}])
    fc = ToolCallConstraint(flag)
    assert fc.accepts('<tool_call>{"name": "f", "arguments": {"on": "tru')
    assert not fc.accepts('<tool_call>{"name": "f", "arguments": {"on": "yes')


def test_a_tool_with_no_properties_takes_no_arguments():
    tools = normalize_tools([{"name": "noargs", "parameters": {"type": "object", "properties": {}}}])
    c = ToolCallConstraint(tools)
    assert c.accepts('<tool_call>{"name": "noargs", "arguments": {}}</tool_call>')
    assert not c.accepts('<tool_call>{"name": "noargs", "arguments": {"x')
    parsed = parse_tool_calls('<tool_call>{"name": "noargs", "arguments": {"x": 1}}</tool_call>', tools)
    assert "unknown property 'x'" in parsed.invalid_tool_calls[0].error


# -- through the engine (scripted members) -----------------------------------------------------
def _engine(*members, **config):
    from specem_core import SpecEM, SpecEMConfig

    return SpecEM(list(members), SpecEMConfig(**{"segment_len": 4, "max_new_tokens": 64, **config}))


def test_engine_parses_calls_and_reports_tool_calls():
    from scripted import ScriptedMember

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    a = ScriptedMember("a", [(call, True)])
    result = _engine(a).generate("Weather in Paris?", tools=[WEATHER])
    assert result.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert result.content == ""
    assert result.text.startswith("<tool_call>")
    as_dict = result.to_dict()
    assert as_dict["tool_calls"][0]["name"] == "get_weather"
    assert as_dict["invalid_tool_calls"] == []
    assert a.calls[0] == "open"


def test_without_tools_results_keep_their_text_as_content():
    from scripted import ScriptedMember

    result = _engine(ScriptedMember("a", [("Hello <tool_call>", True)])).generate("hi")
    assert result.content == result.text == "Hello <tool_call>"
    assert result.tool_calls == []
    assert result.finish_reason == "stop"


def test_constraint_overrules_the_vote_inside_a_call():
    from scripted import ScriptedMember

    # b's candidates score higher (longer) but break the call after round 1
    a = ScriptedMember(
        "a",
        [('<tool_call>\n{"name": "get_weather", ', False), ('"arguments": {"city": "Oslo"}}</tool_call>', True)],
    )
    b = ScriptedMember(
        "b",
        [('<tool_call>\n{"name": "get_weather", "x', False), ('"city": "Rome", "mood": "happy and long"}}', True)],
    )
    result = _engine(a, b).generate("Weather?", tools=[WEATHER])
    assert [s.winner for s in result.segments] == ["a", "a"]
    assert result.tool_calls[0].arguments == {"city": "Oslo"}


@pytest.mark.parametrize(
    ("trusted_tool_calls", "tools", "drafters", "city"),
    [
        (True, True, [["a", "b"], ["b"]], "Oslo"),  # b, the trusted member, writes the call's rest alone
        (False, True, [["a", "b"], ["a", "b"]], "Rome"),  # the vote: a's higher-scored value wins
        (True, False, [["a", "b"], ["a", "b"]], "Rome"),  # no tools: no call to write
    ],
)
def test_trusted_tool_calls_let_the_trusted_member_write_a_started_call(trusted_tool_calls, tools, drafters, city):
    from scripted import ScriptedMember

    from specem_core import MemberWeights, SpecEM, SpecEMConfig

    opening = ('<tool_call>\n{"name": "get_weather", ', False)
    prefer_rome = lambda committed, c: 10.0 if "Rome" in c.text else 1.0  # noqa: E731
    a = ScriptedMember("a", [opening, ('"arguments": {"city": "Rome"}}</tool_call>', True)], scorer=prefer_rome)
    b = ScriptedMember("b", [opening, ('"arguments": {"city": "Oslo"}}</tool_call>', True)], scorer=prefer_rome)
    config = SpecEMConfig(segment_len=4, max_new_tokens=64, trusted_tool_calls=trusted_tool_calls)
    engine = SpecEM([a, b], config, member_weights=MemberWeights({"a": 1.0, "b": 5.0}, learning_rate=0.0))
    result = engine.generate("Weather?", tools=[WEATHER] if tools else None)
    assert [s.drafters for s in result.segments] == drafters
    assert f'"city": "{city}"' in result.text
    if tools:
        assert result.tool_calls[0].arguments == {"city": city}
    if drafters[1] == ["b"]:  # an unvoted round: nobody scored, nothing to learn from
        assert (result.segments[1].verifiers, result.segments[1].raw_scores) == ([], [])
    assert SpecEMConfig(trusted_tool_calls=True, reproduce_paper=True).trusted_tool_calls is False


@pytest.mark.parametrize(
    ("text", "is_call"),
    [
        ('<tool_call>\n{"name": "get_weather", ', True),
        ("Let me check. <tool_call>", True),
        ('  {"name": "get_weather"', True),
        ('[{"name": "a"', True),
        ('```json\n{\n  "name": "calculate', True),
        ('```\n{"name": "a"', True),  # a fence naming nothing, with JSON in it
        ("```", True),  # which fence, not known yet: it may still name json
        ("```python\nprint(1)", False),
        ("```\nprint(1)", False),
        ("To find the slope of the line", False),
        ("The mass of an electron is {about} 9.1e-31 kg", False),  # braces later are words
        ("", False),
        ("   ", False),
    ],
)
def test_opens_call_tells_whether_an_opening_starts_a_call(text, is_call):
    assert opens_call(text) is is_call


@pytest.mark.parametrize(
    ("text", "is_listing"),
    [
        ('<tools>\n{"type": "function", "', True),
        ("  <tools>", True),
        ("The <tools> tag lists them", False),
        ('<tool_call>\n{"name": "a"', False),
        ("", False),
    ],
)
def test_opens_tool_listing_tells_an_echo_of_the_prompt_tools(text, is_listing):
    assert opens_tool_listing(text) is is_listing


_CALL_OPENING = ('<tool_call>\n{"name": "get_weather", ', False)


_WORDS_OPENING = ("It may rain", False)


_LISTING_OPENING = ('<tools>\n{"type": "function", "', False)  # the 0.5B on BFCL simple_python_243


@pytest.mark.parametrize(
    ("unanimous", "small_opening", "trusted_opening", "tools", "tool_choice", "drafters", "opening", "winner"),
    [
        # the trusted member b opens with a call, a in words: the answer opens in a's words
        (True, _WORDS_OPENING, _CALL_OPENING, True, None, ["a", "b"], "It may rain", "a"),
        # both open with a call: the call stands, and b's opening is the only one (trusted opening)
        (True, _CALL_OPENING, _CALL_OPENING, True, None, ["a", "b"], _CALL_OPENING[0], "b"),
        # a repeats the tool listing: that is not words, so b's call stands
        (True, _LISTING_OPENING, _CALL_OPENING, True, None, ["a", "b"], _CALL_OPENING[0], "b"),
        # b opens in words: a's opening could not change that, so a is not asked
        (True, _CALL_OPENING, _WORDS_OPENING, True, None, ["b"], "It may rain", "b"),
        # the rule off: b drafts the opening alone, as before
        (False, _WORDS_OPENING, _CALL_OPENING, True, None, ["b"], _CALL_OPENING[0], "b"),
        # no tools, or a forced call: nothing to decide
        (True, _WORDS_OPENING, _CALL_OPENING, False, None, ["b"], _CALL_OPENING[0], "b"),
        (True, _WORDS_OPENING, _CALL_OPENING, True, "required", ["b"], None, "b"),
    ],
)
def test_unanimous_tool_calls_open_in_words_when_a_drafter_would(
    unanimous, small_opening, trusted_opening, tools, tool_choice, drafters, opening, winner
):
    from scripted import ScriptedMember

    from specem_core import MemberWeights, SpecEM, SpecEMConfig

    a = ScriptedMember("a", [small_opening, (" today.", True)])
    b = ScriptedMember("b", [trusted_opening, (" today.", True)])  # a script: the same whatever came before
    config = SpecEMConfig(segment_len=4, max_new_tokens=64, trusted_opening_rounds=2, unanimous_tool_calls=unanimous)
    engine = SpecEM([a, b], config, member_weights=MemberWeights({"a": 1.0, "b": 5.0}, learning_rate=0.0))
    events = list(engine.stream("Weather?", tools=[WEATHER] if tools else None, tool_choice=tool_choice))
    first = events[0].segment
    assert first is not None
    assert (first.drafters, first.winner) == (drafters, winner)
    assert [c.member for c in first.candidates] == [winner]
    if opening is not None:
        assert first.text == opening
    assert (first.verifiers, first.raw_scores) == ([], [])  # one opening left: nobody votes on it
    result = events[-1].result
    assert result is not None
    if opening == "It may rain":
        assert (result.text, result.tool_calls) == ("It may rain today.", [])  # b went on in words
    assert SpecEMConfig(unanimous_tool_calls=True, reproduce_paper=True).unanimous_tool_calls is False


def test_every_candidate_broken_means_trimmed_candidates():
    from scripted import ScriptedMember

    a = ScriptedMember("a", [('<tool_call>{"name": "get_weather", "arguments": {"city": "A", "town": 1}}', False)])
    b = ScriptedMember("b", [('<tool_call>{"name": "get_weather", "arguments": {"town"', False)])
    events = list(_engine(a, b, max_new_tokens=8).stream("Weather?", tools=[WEATHER]))
    first = events[0].segment
    assert first is not None
    assert first.text == '<tool_call>{"name": "get_weather", "arguments": {"city": "A", "'  # cut at "town"


def test_forced_tool_choice_prefills_the_call():
    from scripted import ScriptedMember

    a = ScriptedMember("a", [('"city": "Lima"}}', True)])
    result = _engine(a).generate("Hello!", tools=[WEATHER, MAGIC], tool_choice="get_weather")
    assert result.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}')
    assert result.tool_calls[0].name == "get_weather"
    assert result.finish_reason == "tool_calls"


def test_forced_call_stops_at_the_close_tag_and_streams_no_markup():
    from scripted import ScriptedMember

    a = ScriptedMember("a", [('"city": "X"}}\n</tool_call>\nMore text', True)])  # name prefilled
    events = list(_engine(a).stream("Hi", tools=[WEATHER], tool_choice="any"))
    assert "".join(e.delta for e in events) == ""
    result = events[-1].result
    assert result is not None
    assert "More text" not in result.text
    assert result.tool_calls[0].arguments == {"city": "X"}


def test_stream_deltas_add_up_to_the_content():
    from scripted import ScriptedMember

    a = ScriptedMember(
        "a",
        [("Let me check", False), (" that. <tool_", False), ('call>{"name": "ping"}</tool_call>', True)],
    )
    events = list(_engine(a).stream("Ping?", tools=[NO_ARGS]))
    result = events[-1].result
    assert result is not None
    assert "".join(e.delta for e in events) == result.content == "Let me check that."
    assert [c.name for c in result.tool_calls] == ["ping"]


async def test_astream_and_agenerate_with_tools():
    from scripted import ScriptedMember

    a = ScriptedMember("a", [('"input": "7"}}', True)])
    engine = _engine(a)
    result = await engine.agenerate("magic 7", tools=[MAGIC], tool_choice="magic_function")
    assert result.tool_calls[0].arguments == {"input": 7}
    deltas = [e.delta async for e in engine.astream("magic 7", tools=[MAGIC], tool_choice="any")]
    assert "".join(deltas) == ""


def test_response_format_json_object():
    from scripted import ScriptedMember

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    good = ScriptedMember("good", [('"a": 1}', True)], scorer=lambda committed, c: 0.0)
    bad = ScriptedMember("bad", [('"b": 2, "c": 3}', True)])
    result = _engine(good, bad).generate("Give JSON", response_format={"type": "json_object", "schema": schema})
    assert json.loads(result.text) == {"a": 1}
    assert result.content == result.text


def test_engine_rejects_bad_tool_input_before_any_work():
    from scripted import ScriptedMember

    a = ScriptedMember("a", [("x", True)])
    engine = _engine(a)
    with pytest.raises(InputError, match="invalid name"):
        engine.generate("hi", tools=[{"name": "bad name"}])
    with pytest.raises(InputError, match="unknown tool_choice"):
        list(engine.stream("hi", tools=[MAGIC], tool_choice="sometimes"))
    assert a.calls == []


def test_a_call_repeating_an_answered_call_gets_an_answer_instead():
    from scripted import ScriptedMember

    call = '<tool_call>{"name": "magic_function", "arguments": {"input": 3}}</tool_call>'
    answers = iter([(call, True), ("The answer is 5.", True)])
    a = ScriptedMember("a", [])
    a.drafts = [next(answers)]
    history = [
        {"role": "user", "content": "magic_function(3)?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "magic_function", "arguments": {"input": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    engine = _engine(a)
    opened = []
    original_open = a.open

    a_requests = []

    def open_and_switch(request):
        opened.append(request.tools)
        a_requests.append(request)
        session = original_open(request)
        if len(opened) == 2:
            a.drafts = [next(answers)]
        return session

    a.open = open_and_switch  # type: ignore[method-assign]
    result = engine.generate(history, tools=[MAGIC])
    assert result.content == "The answer is 5."
    assert result.tool_calls == []
    assert opened[1] is None  # the second pass runs without tools...
    assert "Do not call a tool again" in a_requests[1].messages[0]["content"]  # ...and is told why
    # a new call (other arguments) is kept; a forced choice is never second-guessed
    a.drafts = [('<tool_call>{"name": "magic_function", "arguments": {"input": 4}}</tool_call>', True)]
    opened.clear()
    assert engine.generate(history, tools=[MAGIC]).tool_calls[0].arguments == {"input": 4}
    a.drafts = [('"input": 3}}', True)]
    assert engine.generate(history, tools=[MAGIC], tool_choice="magic_function").tool_calls


def test_forced_any_among_several_tools_lets_the_verifiers_pick_the_tool():
    from scripted import ScriptedMember

    def prefers_weather(committed: str, c: Any) -> float:
        return 5.0 if c.text.startswith("get_weather") else 1.0

    a = ScriptedMember("a", [('"city": "Rome"}}', True)], scorer=prefers_weather)
    result = _engine(a).generate("Hello!", tools=[MAGIC, WEATHER], tool_choice="any")
    assert result.tool_calls[0].name == "get_weather"
    assert result.tool_calls[0].arguments == {"city": "Rome"}
    assert "score" in a.calls


@pytest.mark.parametrize(
    ("committed", "options"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {', ['"city": ']),  # required first
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", ', ['"unit": ', '"days": ']),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"', [", ", "}"]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 1, ', ['"city": ']),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 1', [", "]),  # or more digits
        ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 1 ', [", "]),  # "city" is missing
        ('<tool_call>\n{"name": "get_weather", "arguments": {"days": 1.', []),  # digits must follow
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "unit": ', ['"celsius"', '"fahrenheit"']),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "u', ['nit": ']),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P', []),  # free text
        ('<tool_call>\n{"name": "magic_function", "arguments": {"input": 3 ', ["}"]),  # all properties given
        ('<tool_call>\n{"name": "magic_function", "arguments": {"input": 3}', ["}"]),  # close the call
        ('<tool_call>\n{"name": "magic_function", "arguments": {"input": 3}}', ["</tool_call>"]),
        ('<tool_call>\n{"name": "get_w', ['eather", "arguments": {']),  # the only matching tool
        (
            '<tool_call>\n{"name": "',
            ['get_weather", "arguments": {', 'magic_function", "arguments": {', 'ping", "arguments": {'],
        ),
        ('<tool_call>\n{"name": "get_weather"', [", "]),  # its arguments are required
        ('<tool_call>\n{"name": "ping"', [", ", "}"]),  # ping takes no arguments
        ('<tool_call>\n{"name": "get_weather", ', ['"arguments": {']),
        ("Just text", []),
        ('<tool_call>\n{"name": "nope', []),  # already broken: nothing to offer
    ],
)
def test_listable_continuations(committed, options):
    c = ToolCallConstraint(TOOLS)
    assert c.options(committed) == options
    assert c.forced(committed) == (options[0] if len(options) == 1 else "")
    for option in options:  # every option keeps the call valid
        assert c(committed, option)


def test_json_constraint_options():
    schema = {
        "type": "object",
        "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
        "required": ["setup", "punchline"],
    }
    c = JSONConstraint(schema)
    assert c.options("{") == ['"setup": ', '"punchline": ']
    assert c.forced('{"setup": "a"') == ", "
    assert c.forced('{"setup": "a", ') == '"punchline": '
    assert c.forced('{"setup": "a", "punchline": "b"') == "}"
    assert c.options('{"title": ') == []  # already broken


def test_when_no_draft_fits_the_constraint_writes_the_forced_text():
    from scripted import ScriptedMember

    a = ScriptedMember("a", [("}}", True), ("3}}", True)])  # wants to close before "input"
    result = _engine(a).generate("Hello!", tools=[MAGIC], tool_choice="magic_function")
    assert result.segments[0].winner == "constraint"
    assert result.segments[0].text == '"input": '
    assert result.tool_calls[0].arguments == {"input": 3}


def test_when_no_draft_fits_the_verifiers_vote_among_the_listed_options():
    from scripted import ScriptedMember

    def likes_unit(committed: str, c: Any) -> float:
        return 5.0 if "unit" in c.text else 1.0

    drafts = [('"city": "P", }}', False), ("}}", True), ('"celsius"}}', True)]
    a = ScriptedMember("a", drafts, scorer=likes_unit)
    result = _engine(a).generate("Hello!", tools=[WEATHER], tool_choice="get_weather")
    assert [s.winner for s in result.segments] == ["a", "constraint", "a"]
    assert result.segments[0].text == '"city": "P", '  # cut back
    assert result.segments[1].text == '"unit": '  # voted among "unit" and "days"
    assert result.tool_calls[0].arguments == {"city": "P", "unit": "celsius"}


def test_plain_text_constraint_for_tool_choice_none():
    from specem_core.tools import PlainTextConstraint

    c = PlainTextConstraint()
    assert c("", "The answer is 42.")
    assert c("", "  <tool_")  # could still be text
    assert not c("", "  <tool_call>{")
    assert not c("", '{"name": "x"}')
    assert not c("Sure: ", "<tool_call>")
    assert c("", "[1] is a footnote")
    assert c.trim("", "Ok <tool_call>{") == "Ok <tool_call"
    plan = OutputPlan.build([MAGIC], "none")
    assert plan is not None
    assert isinstance(plan.constraint, PlainTextConstraint)
    assert plan.instruction is None


def test_json_answer_options_open_a_value_of_its_schema_type():
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": {"type": "object"},
        },
        "required": ["city", "n", "tags", "meta"],
    }
    c = JSONConstraint(schema)
    assert c.options("") == ["{"]
    assert c.options('{"city": ') == ['"']
    assert c.options('{"city": "P", "n": ') == ["-", *"0123456789"]
    assert c.options('{"city": "P", "n": 1, "tags": ') == ["["]
    assert c.options('{"city": "P", "n": 1, "tags": [') == ['"', "]"]
    assert c.options('{"city": "P", "n": 1, "tags": [], "meta": ') == ["{"]
    for committed in ('{"city": ', '{"city": "P", "n": 1, "tags": ['):
        for option in c.options(committed):  # every option keeps the answer valid
            assert c(committed, option)
    # tool arguments are coerced after parsing (a string may stand for a number): nothing to list
    assert ToolCallConstraint(TOOLS).options('<tool_call>\n{"name": "get_weather", "arguments": {"city": ') == []


def test_a_json_answer_never_takes_a_value_of_another_type():
    from scripted import ScriptedMember

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    # round 2 writes a number where the schema wants a string: the constraint opens the string
    a = ScriptedMember("a", [('{"city": ', False), ("100000}", True), ('Paris"}', True)])
    result = _engine(a).generate(
        "Hello!", response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    )
    assert json.loads(result.text) == {"city": "Paris"}
    assert "constraint" in [s.winner for s in result.segments]


def test_a_json_answer_array_closes_at_max_items():
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
        "required": ["tags"],
    }
    c = JSONConstraint(schema)
    assert c.options('{"tags": ["a"') == [", ", "]"]
    assert c.options('{"tags": ["a", "b"') == ["]"]  # full: only the close is left
    assert c('{"tags": ["a", "b"', "]}")
    assert not c('{"tags": ["a", "b"', ', "c"]}')
    assert c.trim('{"tags": ["a", "b"', ', "c"]}') == ""
    empty = JSONConstraint({"type": "object", "properties": {"t": {"type": "array", "maxItems": 0}}})
    assert empty.options('{"t": [') == ["]"]
    assert not empty('{"t": [', "1]")


def test_a_json_answer_ends_when_its_object_closes():
    from scripted import ScriptedMember

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = JSONConstraint(schema)
    assert not c.complete('{"a": 1')
    assert c.complete('{"a": 1}\n')
    assert not c.complete('{"a": "x"}')
    # the member would go on with whitespace until the cap: the answer stops at the close
    a = ScriptedMember("a", [('"a": 1}', False), ("\n\n\n\n", False)])
    result = _engine(a, max_new_tokens=40).generate(
        "Hello!", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    )
    assert result.finish_reason == "stop"
    assert json.loads(result.text) == {"a": 1}
    assert len(result.segments) == 1
