"""Tool calling and JSON output for SpecEM: schemas in, parsed calls out, constrained segments.

The ensemble writes tool calls in one canonical syntax whatever each member's chat template
prefers, the Hermes / Qwen2.5 one that :mod:`specem_core.chat_format`'s fallback prompt asks for::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This module holds everything the engine needs around that syntax:

* :func:`normalize_tools` / :func:`normalize_tool_choice` check OpenAI-style tool schemas and
  ``tool_choice`` values (bad input raises :class:`~specem_core.errors.InputError`).
* :func:`parse_tool_calls` turns committed text into answer text, :class:`ToolCall` s (with ids and
  arguments coerced to the tool's JSON schema) and :class:`InvalidToolCall` s. Bare JSON answers
  such as ``{"name": ..., "arguments": ...}`` are accepted too. It never raises on model output.
* :class:`ToolCallConstraint` is a :data:`~specem_core.engine.CandidateFilter`: once a call has
  started, only candidates that keep it a valid JSON *prefix* of a call to a known tool with
  arguments fitting the schema stay in the vote (property names, required properties before an
  object closes, JSON value kinds, string enums). Its :meth:`~ToolCallConstraint.trim` cuts a
  candidate back to its longest acceptable prefix when every candidate breaks the call.
* :class:`OutputPlan` puts it together for one request: which tools to render, a *prefill* (text
  committed before the first round) that forces a call for ``tool_choice="required"`` or a named
  tool, the constraint, and the post-processing of stream events.
* ``response_format`` (``{"type": "json_object"}`` or ``{"type": "json_schema", ...}``) gets the
  same treatment for plain JSON answers: an instruction, a ``{`` prefill and a schema constraint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from specem_core.errors import InputError
from specem_core.types import GenerationResult, InvalidToolCall, StreamEvent, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

ToolChoiceMode = Literal["auto", "none", "required"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_ARGUMENT_KEYS = ("arguments", "parameters")
_CALL_KEYS = ("name", *_ARGUMENT_KEYS)
_FENCE_RE = re.compile(r"^```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?[ \t]*(```)?\s*$", re.DOTALL)


# -- schemas ----------------------------------------------------------------------------------
def normalize_tool(tool: object, index: int = 0) -> dict[str, Any]:
    """Check one tool schema and return it as ``{"type": "function", "function": {...}}``.

    Accepts the OpenAI shape (``{"type": "function", "function": {"name", "description",
    "parameters"}}``) or its inner ``function`` object.

    Raises:
        InputError: the schema has no usable name or its ``parameters`` is not a JSON-schema object.
    """
    if not isinstance(tool, Mapping):
        raise InputError(f"tool {index} must be an OpenAI-style schema dict, got {type(tool).__name__}")
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise InputError(f"tool {index} has type {tool.get('type')!r}; only 'function' tools are supported")
        fn = tool["function"]
        if not isinstance(fn, Mapping):
            raise InputError(f"tool {index}: 'function' must be a dict, got {type(fn).__name__}")
    else:
        fn = tool
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InputError(f"tool {index} has an invalid name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InputError(f"tool {name!r}: description must be a string, got {type(description).__name__}")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise InputError(f"tool {name!r}: parameters must be a JSON-schema object, got {type(params).__name__}")
    params = dict(params)
    if params.get("type", "object") != "object":
        raise InputError(f"tool {name!r}: parameters must have type 'object', got {params.get('type')!r}")
    params.setdefault("type", "object")
    props = params.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
        raise InputError(f"tool {name!r}: parameters.properties must map names to JSON schemas")
    required = params.get("required", [])
    if not isinstance(required, list | tuple) or not all(isinstance(r, str) for r in required):
        raise InputError(f"tool {name!r}: parameters.required must be a list of property names")
    if props and params.get("additionalProperties") in (None, False):
        missing = [r for r in required if r not in props]
        if missing:
            raise InputError(f"tool {name!r}: required properties {missing} are not in parameters.properties")
    try:
        json.dumps(params)
    except (TypeError, ValueError) as exc:
        raise InputError(f"tool {name!r}: parameters are not JSON-serializable ({exc})") from exc
    out_fn: dict[str, Any] = {"name": name, "description": description, "parameters": params}
    if "strict" in fn:
        out_fn["strict"] = fn["strict"]
    return {"type": "function", "function": out_fn}


def normalize_tools(tools: Sequence[object] | None) -> list[dict[str, Any]]:
    """:func:`normalize_tool` for each tool; names must be unique.

    Raises:
        InputError: a bad schema or a repeated name.
    """
    if tools is None:
        return []
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise InputError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    seen: dict[str, Any] = {}
    for i, t in enumerate(tools):
        tool = normalize_tool(t, i)
        name = tool["function"]["name"]
        shape = _without_titles(tool["function"]["parameters"])
        if name in seen:
            if seen[name] != shape:
                raise InputError(f"tool names must be unique; repeated with different parameters: {name}")
            continue  # the same tool twice (e.g. a pydantic model and its JSON schema)
        seen[name] = shape
        out.append(tool)
    return out


def _without_titles(schema: Any) -> Any:
    """A schema without its ``title`` annotations (to tell two spellings of one tool apart)."""
    if isinstance(schema, Mapping):
        return {k: _without_titles(v) for k, v in schema.items() if k != "title" or not isinstance(v, str)}
    if isinstance(schema, list):
        return [_without_titles(v) for v in schema]
    return schema


@dataclass(frozen=True)
class ToolChoice:
    """A normalized ``tool_choice``."""

    mode: ToolChoiceMode
    """``auto``: the ensemble decides; ``none``: no call; ``required``: at least one call."""
    name: str | None = None
    """With ``mode="required"``: the tool that must be called (``None``: any of them)."""


def normalize_tool_choice(choice: object, tools: Sequence[Mapping[str, Any]]) -> ToolChoice:
    """Read a ``tool_choice`` in any of the usual shapes.

    Accepted: ``None``/``"auto"``, ``"none"``, ``"any"``/``"required"``/``True``, a tool name,
    ``{"type": "function", "function": {"name": ...}}``, ``{"type": "tool", "name": ...}`` and
    ``{"type": "auto" | "any" | "none" | "required"}``.

    Raises:
        InputError: an unknown value, or a tool name that is not among ``tools``.
    """
    names = [t["function"]["name"] for t in tools]

    def named(name: object) -> ToolChoice:
        if name not in names:
            raise InputError(
                f"tool_choice names tool {name!r}, which is not among the given tools ({', '.join(names) or 'none'})"
            )
        return ToolChoice("required", str(name))

    if choice is None or choice == "auto":
        return ToolChoice("auto")
    if choice is True or choice in ("any", "required"):
        return ToolChoice("required")
    if choice is False or choice == "none":
        return ToolChoice("none")
    if isinstance(choice, str):
        if choice in names:
            return ToolChoice("required", choice)
        raise InputError(
            f"unknown tool_choice {choice!r}: use 'auto', 'none', 'any' (or 'required'), "
            f"or the name of a given tool ({', '.join(names) or 'no tools given'})"
        )
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        fn = choice.get("function")
        if isinstance(fn, Mapping) and "name" in fn:
            return named(fn["name"])
        if kind in ("function", "tool") and "name" in choice:
            return named(choice["name"])
        if kind in ("auto", "any", "none", "required"):
            return normalize_tool_choice(kind, tools)
    raise InputError(f"unknown tool_choice {choice!r}: use 'auto', 'none', 'any', or a tool name")


# -- JSON-schema helpers ----------------------------------------------------------------------
def _resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """Follow local ``$ref`` s (``#/$defs/X``, ``#/definitions/X``); a single ``allOf`` is unwrapped."""
    seen = 0
    while isinstance(schema, Mapping) and seen < 32:
        seen += 1
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            target: Any = root
            for part in ref[2:].split("/"):
                target = target.get(part) if isinstance(target, Mapping) else None
            if not isinstance(target, Mapping):
                return {}
            merged = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **merged}
            continue
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            schema = {**all_of[0], **rest} if isinstance(all_of[0], Mapping) else rest
            continue
        return schema
    return schema if isinstance(schema, Mapping) else {}


def _types(schema: Mapping[str, Any]) -> set[str] | None:
    """The JSON types a schema allows (``None`` = anything)."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {str(x) for x in t}
    if "enum" in schema and isinstance(schema["enum"], list):
        return {_json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {_json_type(schema["const"])}
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _variants(schema: Mapping[str, Any]) -> list[Any] | None:
    for key in ("anyOf", "oneOf"):
        v = schema.get(key)
        if isinstance(v, list) and v:
            return v
    return None


class _CoerceError(ValueError):
    pass


def coerce_arguments(args: Mapping[str, Any], parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Coerce tool arguments to the tool's JSON schema (``"7"`` → ``7`` for an integer).

    Raises:
        ValueError: the arguments cannot fit the schema (missing required property, unknown
            property where none are allowed, a value of the wrong kind, a value not in an enum).
    """
    out = _coerce(dict(args), parameters, parameters, "arguments")
    assert isinstance(out, dict)
    return out


def _coerce(value: Any, schema: Any, root: Mapping[str, Any], path: str) -> Any:
    schema = _resolve(schema, root)
    if not isinstance(schema, Mapping) or not schema:
        return value
    variants = _variants(schema)
    if variants is not None:
        errors: list[str] = []
        for v in variants:  # exact matches first, then coercions
            if _matches_exactly(value, v, root):
                return _coerce(value, v, root, path)
        for v in variants:
            try:
                return _coerce(value, v, root, path)
            except _CoerceError as exc:
                errors.append(str(exc))
        raise _CoerceError(errors[0] if errors else f"{path}: no variant matches")
    types = _types(schema)
    result = value if types is None else _coerce_kind(value, types, schema, root, path)
    if "enum" in schema and isinstance(schema["enum"], list) and result not in schema["enum"]:
        raise _CoerceError(f"{path}: {result!r} is not one of {schema['enum']}")
    if "const" in schema and result != schema["const"]:
        raise _CoerceError(f"{path}: must be {schema['const']!r}")
    return result


def _matches_exactly(value: Any, schema: Any, root: Mapping[str, Any]) -> bool:
    schema = _resolve(schema, root)
    if not isinstance(schema, Mapping):
        return True
    types = _types(schema)
    if types is None:
        return True
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _coerce_kind(value: Any, types: set[str], schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> Any:
    kind = _json_type(value)
    if kind in types and kind not in ("object", "array"):
        return value
    if kind == "integer" and "number" in types:
        return value
    if kind == "object" and "object" in types:
        return _coerce_object(value, schema, root, path)
    if kind == "array" and "array" in types:
        items = schema.get("items")
        return [_coerce(v, items, root, f"{path}[{i}]") for i, v in enumerate(value)]
    # Coercions, in a fixed order.
    if "integer" in types:
        if kind == "number" and float(value).is_integer():
            return int(value)
        if kind == "string" and re.fullmatch(r"\s*-?\d+\s*", value):
            return int(value)
    if "number" in types and kind == "string":
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if number == number and number not in (float("inf"), float("-inf")):
                return int(number) if re.fullmatch(r"\s*-?\d+\s*", value) else number
    if "boolean" in types and kind == "string" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if "string" in types and kind in ("integer", "number", "boolean"):
        return json.dumps(value)
    if "null" in types and kind == "string" and value.strip().lower() in ("null", "none"):
        return None
    if kind == "string" and types & {"object", "array"}:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if parsed is not None and _json_type(parsed) in types:
            return _coerce_kind(parsed, types, schema, root, path)
    expected = " or ".join(sorted(types))
    raise _CoerceError(f"{path}: expected {expected}, got {kind} {json.dumps(value, ensure_ascii=False)[:40]}")


def _coerce_object(value: Mapping[str, Any], schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> Any:
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, v in value.items():
        sub = f"{path}.{key}"
        if key in props:
            out[key] = _coerce(v, props[key], root, sub)
        elif "properties" in schema and extra in (None, False):
            expected = ", ".join(props) or "no arguments"
            raise _CoerceError(f"{path}: unknown property {key!r} (expected {expected})")
        elif isinstance(extra, Mapping):
            out[key] = _coerce(v, extra, root, sub)
        else:
            out[key] = v
    missing = [r for r in schema.get("required", []) if r not in out]
    if missing:
        raise _CoerceError(f"{path}: missing required {', '.join(repr(m) for m in missing)}")
    return out


# -- parsing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedResponse:
    """Committed text split into answer text and tool calls."""

    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]


def new_call_id() -> str:
    """A fresh ``call_<hex>`` id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _regions(text: str) -> tuple[list[tuple[int, int]], list[str]]:
    """Spans of ``<tool_call>`` regions (tags included) and their bodies; a region ends at its
    close tag, at the next open tag, or at the end of the text."""
    spans: list[tuple[int, int]] = []
    bodies: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start == -1:
            break
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        nxt = text.find(TOOL_CALL_OPEN, body_start)
        if close != -1 and (nxt == -1 or close < nxt):
            end, body_end = close + len(TOOL_CALL_CLOSE), close
        elif nxt != -1:
            end = body_end = nxt
        else:
            end = body_end = len(text)
        spans.append((start, end))
        bodies.append(text[body_start:body_end])
        pos = end
    return spans, bodies


def _strip_fence(body: str) -> str:
    body = body.strip()
    if body.startswith("```"):
        m = _FENCE_RE.match(body)
        if m:
            return m.group(1).strip()
    return body


def _close_json(text: str) -> str | None:
    """Close the strings, objects and arrays a truncated JSON text left open (best effort)."""
    stack: list[str] = []
    in_string = False
    escape = False
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack[-1] != ch:
                return None
            stack.pop()
    out = text
    if in_string:
        out += "\\" if escape else ""
        out += '"'
    out = out.rstrip()
    while True:  # drop a dangling separator or a key without its value
        if out.endswith(","):
            out = out[:-1].rstrip()
        elif out.endswith(":"):
            key = re.search(r'(,\s*)?"(?:[^"\\]|\\.)*"\s*:$', out)
            if key is None:
                return None
            out = out[: key.start()].rstrip()
        else:
            break
    return out + "".join(reversed(stack))


def loads_lenient(text: str) -> Any:
    """``json.loads`` that also takes a fenced block, trailing text after the value, or a value
    cut short (unclosed strings, objects and arrays are closed).

    Raises:
        ValueError: no JSON value can be read.
    """
    body = _strip_fence(text)
    try:
        return json.loads(body, strict=False)
    except ValueError:
        pass
    start = min((i for i in (body.find("{"), body.find("[")) if i != -1), default=-1)
    if start == -1:
        raise ValueError("no JSON object found")
    body = body[start:]
    try:
        return json.JSONDecoder(strict=False).raw_decode(body)[0]
    except ValueError:
        pass
    closed = _close_json(body)
    if closed is None:
        raise ValueError("unbalanced JSON")
    try:
        return json.loads(closed, strict=False)
    except ValueError as exc:
        raise ValueError(f"invalid JSON: {exc}") from exc


def _call_parts(obj: Any) -> tuple[Any, Any]:
    """(name, arguments) of a call object in the Hermes, OpenAI or Llama-3.1 shape."""
    if not isinstance(obj, Mapping):
        return None, None
    fn = obj.get("function")
    if isinstance(fn, Mapping) and "name" in fn:
        obj = fn
    args: Any = None
    for key in (*_ARGUMENT_KEYS, "args", "input"):
        if key in obj:
            args = obj[key]
            break
    return obj.get("name"), args


def _make_call(obj: Any, raw: str, tools: Mapping[str, Mapping[str, Any]]) -> ToolCall | InvalidToolCall:
    name, args = _call_parts(obj)
    raw_args = raw if args is None else (args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    if not isinstance(name, str) or not name:
        return InvalidToolCall(new_call_id(), None, raw, "the call has no tool name")
    if tools and name not in tools:
        return InvalidToolCall(new_call_id(), name, raw_args, f"unknown tool {name!r} (known: {', '.join(tools)})")
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = loads_lenient(args) if args.strip() else {}
        except ValueError:
            return InvalidToolCall(new_call_id(), name, raw_args, "arguments are not valid JSON")
    if not isinstance(args, Mapping):
        error = f"arguments must be a JSON object, got {_json_type(args)}"
        return InvalidToolCall(new_call_id(), name, raw_args, error)
    schema = tools.get(name, {}).get("parameters") if tools else None
    if schema:
        try:
            args = coerce_arguments(args, schema)
        except ValueError as exc:
            return InvalidToolCall(new_call_id(), name, raw_args, str(exc))
    return ToolCall(new_call_id(), name, dict(args))


def _calls_from_json(body: str, tools: Mapping[str, Mapping[str, Any]]) -> list[ToolCall | InvalidToolCall]:
    try:
        value = loads_lenient(body)
    except ValueError as exc:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return [InvalidToolCall(new_call_id(), name.group(1) if name else None, body.strip() or None, str(exc))]
    items = value if isinstance(value, list) and value else [value]
    return [_make_call(item, body.strip(), tools) for item in items]


def _tool_index(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in normalize_tools(tools)} if tools else {}


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedResponse:
    """Split committed text into answer text, tool calls and invalid tool calls. Never raises.

    ``<tool_call>…</tool_call>`` regions (the close tag may be missing at the end) are calls;
    without any, an answer that is only a JSON call object (optionally fenced) naming a given
    tool is one too. Arguments are coerced to the tool's schema; calls that fail go to
    ``invalid_tool_calls`` with the reason. ``content`` is the text outside the calls, with
    leading whitespace removed (and trailing whitespace too when there are calls).
    """
    index = _tool_index(tools)
    spans, bodies = _regions(text)
    calls: list[ToolCall | InvalidToolCall] = []
    if spans:
        pieces: list[str] = []
        pos = 0
        for (start, end), body in zip(spans, bodies, strict=True):
            pieces.append(text[pos:start])
            pos = end
            calls.extend(_calls_from_json(body, index))
        pieces.append(text[pos:])
        content = "".join(pieces).strip()
    else:
        content = text.lstrip()
        bare = _strip_fence(content)
        if index and bare.startswith(("{", "[")):
            try:
                value = loads_lenient(bare)
            except ValueError:
                value = None
            items = value if isinstance(value, list) else [value]
            if items and all(_call_parts(v)[0] in index for v in items):
                calls = [_make_call(v, bare, index) for v in items]
                content = ""
    valid = [c for c in calls if isinstance(c, ToolCall)]
    invalid = [c for c in calls if isinstance(c, InvalidToolCall)]
    return ParsedResponse(content, valid, invalid)


# -- the JSON-prefix constraint -----------------------------------------------------------------
class _Incomplete(Exception):
    """The text ended inside a value: what was read is a valid prefix.

    ``options`` are the continuations a valid document can have from here when they can be
    listed (the remaining property names, the matching tool names or enum values, a closing
    brace…); empty when the next text is free (a string's content, a number)."""

    def __init__(self, *options: str, may_end: bool = False) -> None:
        super().__init__(*options)
        self.options = [o for o in dict.fromkeys(options) if o]
        self.may_end = may_end
        """The value read so far is complete (a number): what may follow it is an option too."""


class _Invalid(Exception):
    """The text cannot be the prefix of a valid value."""


_NUMBER_PREFIX = re.compile(r"-?(0|[1-9]\d*)?(\.\d*)?([eE][+-]?\d*)?")
_NUMBER_FULL = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_INTEGER_PREFIX = re.compile(r"-?(0|[1-9]\d*)?")
_LITERALS = {"t": ("true", "boolean"), "f": ("false", "boolean"), "n": ("null", "null")}


_NUMERIC_STRING = re.compile(r"\s*-?\d*(\.\d*)?\s*")
_BOOLEAN_STRING = re.compile(r"\s*(t(r(ue?)?)?|f(a(l(se?)?)?)?|T(r(ue?)?)?|F(a(l(se?)?)?)?)?\s*")


def _string_pattern(types: set[str] | None) -> re.Pattern[str] | None:
    """What a string may hold when it stands for a non-string value (it is coerced later)."""
    if not types or types & {"string", "object", "array"}:
        return None
    if types <= {"integer", "number", "null"}:
        return _NUMERIC_STRING
    if types <= {"boolean", "null"}:
        return _BOOLEAN_STRING
    return None


def _key_options(
    props: Mapping[str, Any], closed: bool, required: Sequence[str], seen: set[str], *, closing: bool = True
) -> list[str]:
    """What may come where an object's next key (or its end) goes."""
    missing = [r for r in required if r not in seen]
    if missing:  # required properties come first (the object cannot close without them)
        return [f'"{r}": ' for r in missing] if closed else [f'"{missing[0]}": ']
    if closed:
        return [f'"{p}": ' for p in props if p not in seen] + (["}"] if closing else [])
    return []


def _value_options(schema: Any) -> list[str]:
    """The listable values of a schema: string enums and booleans (else: free)."""
    if not isinstance(schema, Mapping):
        return []
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return [json.dumps(e, ensure_ascii=False) for e in enum]
    if _types(schema) == {"boolean"}:
        return ["true", "false"]
    return []


class _PrefixParser:
    """Recursive-descent JSON parser that accepts any prefix of a valid document.

    Reaching the end of the text raises :class:`_Incomplete` (a valid prefix); a character that
    no valid document could have raises :class:`_Invalid`. Schemas are checked on the way.
    """

    def __init__(self, text: str, root: Mapping[str, Any] | None = None, *, strict: bool = False) -> None:
        self.s = text
        self.i = 0
        self.root: Mapping[str, Any] = root or {}
        self.strict = strict
        """Values must have the schema's JSON types as written (a JSON answer is returned as is);
        otherwise a string may stand for a number or boolean and a number for a string, as tool
        arguments are coerced to their schema after parsing."""

    # basic reading
    def peek(self) -> str:
        if self.i >= len(self.s):
            raise _Incomplete
        return self.s[self.i]

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1

    def expect(self, ch: str) -> None:
        self.ws()
        if self.i >= len(self.s):
            raise _Incomplete(ch)
        if self.s[self.i] != ch:
            raise _Invalid(f"expected {ch!r} at {self.i}")
        self.i += 1

    def end_or(self, *options: str) -> None:
        """At the end of the text, stop here with these continuations as the options."""
        self.ws()
        if self.i >= len(self.s):
            raise _Incomplete(*options)

    def string(
        self, allowed: Sequence[str] | None = None, pattern: re.Pattern[str] | None = None, after: str = ""
    ) -> str:
        """A JSON string; with ``allowed`` its value must be (a prefix of, while open) one of them;
        with ``pattern`` its value so far must match it (a prefix pattern). ``after`` is what
        must follow the string (used for the forced continuation)."""
        if allowed is not None:
            self.end_or(*(f'"{a}"{after}' for a in allowed))
        if self.peek() != '"':
            raise _Invalid("expected a string")
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s):
                so_far = "".join(out)
                matches = [a for a in allowed if a.startswith(so_far)] if allowed is not None else None
                if matches is not None and not matches:
                    raise _Invalid("string is not a prefix of an allowed value")
                if matches is not None:
                    raise _Incomplete(*(f'{m[len(so_far) :]}"{after}' for m in matches))
                raise _Incomplete
            ch = self.s[self.i]
            if ch == '"':
                self.i += 1
                value = "".join(out)
                if allowed is not None and value not in allowed:
                    raise _Invalid(f"{value!r} is not one of {list(allowed)}")
                return value
            if ch == "\\":
                out.append(self._escape())
                continue
            out.append(ch)
            self.i += 1
            if allowed is not None and not any(a.startswith("".join(out)) for a in allowed):
                raise _Invalid("string is not a prefix of an allowed value")
            if pattern is not None and not pattern.fullmatch("".join(out)):
                raise _Invalid("string cannot become a value of the schema's type")

    def _escape(self) -> str:
        self.i += 1
        ch = self.peek()
        simple = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
        if ch in simple:
            self.i += 1
            return simple[ch]
        if ch != "u":
            raise _Invalid("bad escape")
        self.i += 1
        digits = self.s[self.i : self.i + 4]
        if not re.fullmatch(r"[0-9a-fA-F]*", digits):
            raise _Invalid("bad \\u escape")
        if len(digits) < 4:
            raise _Incomplete
        self.i += 4
        return chr(int(digits, 16))

    def number(self, *, integer: bool = False) -> None:
        """A JSON number; with ``integer`` no fraction or exponent."""
        m = (_INTEGER_PREFIX if integer else _NUMBER_PREFIX).match(self.s, self.i)
        end = m.end() if m else self.i
        if end == len(self.s):
            if end == self.i and self.s[self.i : self.i + 1] != "-":
                raise _Invalid("expected a number")
            # a number can always grow; a complete one may also end here
            raise _Incomplete(may_end=bool(_NUMBER_FULL.fullmatch(self.s, self.i, end)))
        if not _NUMBER_FULL.fullmatch(self.s, self.i, end):
            raise _Invalid("malformed number")
        self.i = end

    def literal(self) -> str:
        word, kind = _LITERALS[self.peek()]
        got = self.s[self.i : self.i + len(word)]
        if not word.startswith(got):
            raise _Invalid("bad literal")
        if len(got) < len(word):
            raise _Incomplete
        self.i += len(word)
        return kind

    # values with schemas
    def value(self, schema: Any = None) -> None:
        schema = _resolve(schema, self.root) if schema else {}
        self.end_or(*_value_options(schema))
        ch = self.peek()
        variants = _variants(schema) if isinstance(schema, Mapping) else None
        types = _types(schema) if isinstance(schema, Mapping) and schema and variants is None else None
        if variants is not None:
            kinds: set[str] = set()
            for v in variants:
                t = _types(_resolve(v, self.root))
                if t is None:
                    kinds = set()
                    break
                kinds |= t
            self._check_kind(ch, kinds or None, strict=self.strict)
            self._generic(ch)  # unions: structure only
            return
        self._check_kind(ch, types, strict=self.strict)
        if ch == "{":
            self.obj(schema if types is None or "object" in types else {})
        elif ch == "[":
            self.arr(schema.get("items") if isinstance(schema, Mapping) else None)
        elif ch == '"':
            enum = schema.get("enum") if isinstance(schema, Mapping) else None
            allowed = [e for e in enum if isinstance(e, str)] if isinstance(enum, list) else None
            if allowed is not None and types is not None and types != {"string"}:
                allowed = None  # mixed enums: no prefix check
            self.string(allowed or None, None if self.strict else _string_pattern(types))
        elif ch in "-0123456789":
            self.number(integer=self.strict and types is not None and "number" not in types)
        elif ch in _LITERALS:
            self.literal()
        else:
            raise _Invalid(f"unexpected {ch!r}")

    def value_then(self, schema: Any, after: Sequence[str]) -> None:
        """:meth:`value`; when the text ends in a value that may also end there, what may follow
        it (``after``) is offered as an option."""
        try:
            self.value(schema)
        except _Incomplete as exc:
            if exc.may_end and not exc.options:
                raise _Incomplete(*after) from exc
            raise

    def _generic(self, ch: str) -> None:
        if ch == "{":
            self.obj({})
        elif ch == "[":
            self.arr(None)
        elif ch == '"':
            self.string()
        elif ch in "-0123456789":
            self.number()
        elif ch in _LITERALS:
            self.literal()
        else:
            raise _Invalid(f"unexpected {ch!r}")

    @staticmethod
    def _check_kind(ch: str, types: set[str] | None, *, strict: bool = False) -> None:
        """Reject a value whose first character cannot fit the schema (after coercion, unless
        ``strict``)."""
        if not types:
            return
        # without strict, strings coerce to numbers, booleans, null, objects and arrays, and
        # numbers, booleans and null to strings
        loose = set() if strict else {"string"}
        if ch == "{":
            ok = "object" in types
        elif ch == "[":
            ok = "array" in types
        elif ch == '"':
            ok = "string" in types or not strict
        elif ch in "-0123456789":
            ok = bool(types & {"integer", "number", *loose})
        elif ch in "tf":
            ok = bool(types & {"boolean", *loose})
        elif ch == "n":
            ok = bool(types & {"null", *loose})
        else:
            ok = False
        if not ok:
            raise _Invalid(f"a value starting with {ch!r} cannot be {' or '.join(sorted(types))}")

    def obj(self, schema: Mapping[str, Any]) -> None:
        self.expect("{")
        props: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        closed = "properties" in schema and extra in (None, False)
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        seen: set[str] = set()
        self.end_or(*_key_options(props, closed, required, seen))
        if self.peek() == "}":
            if required:
                raise _Invalid(f"missing required {required}")
            self.i += 1
            return
        while True:
            allowed = [p for p in props if p not in seen] if closed else None
            if closed or any(r not in seen for r in required):
                self.end_or(*_key_options(props, closed, required, seen, closing=False))
            key = self.string(allowed, after=": ")
            if key in seen:
                raise _Invalid(f"repeated key {key!r}")
            seen.add(key)
            self.expect(":")
            sub = props.get(key) if key in props else (extra if isinstance(extra, Mapping) else None)
            missing = [r for r in required if r not in seen]
            left = not closed or any(p not in seen for p in props)
            after = [*([", "] if left else []), *([] if missing else ["}"])]
            self.value_then(sub, after)
            self.end_or(*after)
            ch = self.peek()
            if ch == ",":
                self.i += 1
                if closed and all(p in seen for p in props):
                    raise _Invalid("no property left")
                continue
            if ch == "}":
                missing = [r for r in required if r not in seen]
                if missing:
                    raise _Invalid(f"missing required {missing}")
                self.i += 1
                return
            raise _Invalid(f"expected ',' or '}}' at {self.i}")

    def arr(self, items: Any) -> None:
        self.expect("[")
        self.ws()
        if self.peek() == "]":
            self.i += 1
            return
        while True:
            self.value_then(items, [", ", "]"])
            self.end_or(", ", "]")
            ch = self.peek()
            if ch == ",":
                self.i += 1
                continue
            if ch == "]":
                self.i += 1
                return
            raise _Invalid(f"expected ',' or ']' at {self.i}")

    def call(self, tools: Mapping[str, Mapping[str, Any]]) -> None:
        """A Hermes call object ``{"name": <tool>, "arguments": {...}}`` (keys in any order)."""
        self.expect("{")
        name: str | None = None
        seen: set[str] = set()
        deferred_args: str | None = None
        while True:
            has_args = bool(seen & set(_ARGUMENT_KEYS))
            allowed = [k for k in _CALL_KEYS if k not in seen and not (k in _ARGUMENT_KEYS and has_args)]
            if "name" in seen and not has_args:
                self.end_or('"arguments": {')
            key = self.string(allowed, after=": ")
            seen.add(key)
            self.expect(":")
            if key == "name":
                name = self.string(list(tools), after="" if has_args else ', "arguments": {')
                if deferred_args is not None:  # arguments came first: check them now
                    self._check_arguments(deferred_args, tools[name])
            else:
                start = self.i
                schema = tools[name].get("parameters") if name is not None else None
                self.ws()
                if self.peek() == '"':  # arguments as a JSON string: coerced when parsed
                    self.string()
                else:
                    self._check_kind(self.peek(), {"object"})
                    saved, self.root = self.root, (schema or {})
                    self.value(schema if schema else {})
                    self.root = saved
                if name is None:
                    deferred_args = self.s[start : self.i]
            done = name is not None and bool(seen & set(_ARGUMENT_KEYS))
            optional = name is not None and not (tools[name].get("parameters") or {}).get("required")
            self.end_or(*(["}"] if done else [", ", "}"] if optional else [", "]))
            ch = self.peek()
            if ch == ",":
                if done:
                    raise _Invalid("the call has a name and arguments already")
                self.i += 1
                continue
            if ch == "}":
                if name is None:
                    raise _Invalid("the call has no name")
                params = tools[name].get("parameters") or {}
                if not seen & set(_ARGUMENT_KEYS) and params.get("required"):
                    raise _Invalid("the call has no arguments")
                self.i += 1
                return
            raise _Invalid(f"expected ',' or '}}' at {self.i}")

    def _check_arguments(self, text: str, tool: Mapping[str, Any]) -> None:
        sub = _PrefixParser(text.strip(), tool.get("parameters") or {})
        try:
            if sub.s.startswith('"'):
                return
            sub.value(tool.get("parameters") or {})
        except _Incomplete as exc:
            raise _Invalid("truncated arguments") from exc


def _check_call_text(body: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[bool, int | None]:
    """(valid prefix?, end of the call object or ``None`` while it is still open)."""
    parser = _PrefixParser(body)
    try:
        parser.ws()
        if parser.i >= len(body):
            return True, None
        parser.call(tools)
    except _Incomplete:
        return True, None
    except _Invalid:
        return False, None
    return True, parser.i


class ToolCallConstraint:
    """Keeps started tool calls parseable (a :data:`~specem_core.engine.CandidateFilter`).

    ``constraint(committed, candidate)`` is true when every ``<tool_call>`` region that
    ``committed + candidate`` touches beyond ``committed`` is a valid prefix of
    ``<tool_call>{"name": <a given tool>, "arguments": <fits its schema>}</tool_call>``. Text
    outside calls is free. With ``single_call`` nothing may follow a closed call but whitespace;
    otherwise only whitespace or another call.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]], *, single_call: bool = False) -> None:
        self._tools = _tool_index(tools)
        self._single = single_call

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.accepts(committed + candidate, len(committed))

    def accepts(self, text: str, start: int = 0) -> bool:
        """Whether ``text`` is acceptable, looking only at what reaches past ``start``."""
        spans, bodies = _regions(text)
        for n, ((s, e), body) in enumerate(zip(spans, bodies, strict=True)):
            limit = spans[n + 1][0] if n + 1 < len(spans) else len(text)
            if limit <= start:
                continue  # this call and the text after it were committed already
            closed = text.startswith(TOOL_CALL_CLOSE, s + len(TOOL_CALL_OPEN) + len(body))
            if e > start:
                ok, end = _check_call_text(body, self._tools)
                if not ok:
                    return False
                if end is None:
                    if e < len(text):
                        return False  # a new call opened inside an unfinished one
                    continue  # still open: a valid prefix
                rest = body[end:].lstrip()
                if not closed and e == len(text):
                    if not TOOL_CALL_CLOSE.startswith(rest):
                        return False  # only the close tag may follow the call
                    continue
                if rest or not closed:
                    return False
            if self._single:
                continue  # the request stops at the close tag: what follows is never kept
            after = text[e:limit].strip()
            if after and (n + 1 < len(spans) or not TOOL_CALL_OPEN.startswith(after)):
                return False  # between calls only whitespace
        return True

    def forced(self, committed: str) -> str:
        """The only valid continuation of an unfinished call at the end of ``committed``, if any
        (the next required argument name, the rest of the only matching tool name, a closing
        brace...); ``""`` when the text is free or the next step is a real choice."""
        options = self.options(committed)
        return options[0] if len(options) == 1 else ""

    def options(self, committed: str) -> list[str]:
        """The continuations an unfinished call at the end of ``committed`` can have, when they
        can be listed (tool names, argument names, enum values, closing braces, the close tag);
        empty when the text is free or there is no open call."""
        spans, bodies = _regions(committed)
        if not spans or spans[-1][1] != len(committed):
            return []
        body = bodies[-1]
        if committed.endswith(TOOL_CALL_CLOSE) or not self.accepts(committed, spans[-1][0]):
            return []
        parser = _PrefixParser(body)
        try:
            parser.end_or("{")
            parser.call(self._tools)
        except _Incomplete as exc:
            return exc.options
        except _Invalid:
            return []
        rest = body[parser.i :].lstrip()
        return [TOOL_CALL_CLOSE[len(rest) :]] if TOOL_CALL_CLOSE.startswith(rest) else []

    def trim(self, committed: str, candidate: str) -> str:
        """The longest prefix of ``candidate`` that keeps ``committed + prefix`` acceptable."""
        lo, hi = 0, len(candidate)
        while lo < hi:  # acceptability is prefix-closed: binary search
            mid = (lo + hi + 1) // 2
            if self(committed, candidate[:mid]):
                lo = mid
            else:
                hi = mid - 1
        return candidate[:lo]


class JSONConstraint:
    """Keeps a whole JSON answer a valid prefix of a JSON object fitting ``schema``.

    A :data:`~specem_core.engine.CandidateFilter` for ``response_format``; leading whitespace is
    allowed, trailing text after the closed object is not.
    """

    def __init__(self, schema: Mapping[str, Any] | None = None) -> None:
        self._schema = dict(schema) if schema else {"type": "object"}

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.accepts(committed + candidate)

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is a prefix of a JSON object fitting the schema."""
        parser = _PrefixParser(text, self._schema, strict=True)
        try:
            parser.ws()
            if parser.i >= len(text):
                return True
            parser.value(self._schema)
        except _Incomplete:
            return True
        except _Invalid:
            return False
        return not text[parser.i :].strip()

    def forced(self, committed: str) -> str:
        """The only valid continuation of the JSON answer at the end of ``committed``, if any."""
        options = self.options(committed)
        return options[0] if len(options) == 1 else ""

    def options(self, committed: str) -> list[str]:
        """The continuations of the JSON answer at the end of ``committed``, when they can be listed."""
        if not self.accepts(committed):
            return []
        parser = _PrefixParser(committed, self._schema, strict=True)
        try:
            parser.value(self._schema)
        except _Incomplete as exc:
            return exc.options
        except _Invalid:
            return []
        return []

    def trim(self, committed: str, candidate: str) -> str:
        """The longest prefix of ``candidate`` that keeps the answer acceptable."""
        return _longest_accepted_prefix(self, committed, candidate)


class PlainTextConstraint:
    """Keeps an answer from starting a tool call or a JSON object (``tool_choice="none"``).

    Rejects text whose first non-space characters are ``<tool_call>``, ``{`` or a ```` ```json ````
    fence, and any text containing ``<tool_call>``.
    """

    MARKERS = (TOOL_CALL_OPEN, "{", "```json")

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.accepts(committed + candidate)

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is not a call or a JSON answer."""
        head = text.lstrip()
        return not head.startswith(self.MARKERS) and TOOL_CALL_OPEN not in head

    def trim(self, committed: str, candidate: str) -> str:
        """The longest prefix of ``candidate`` that keeps the answer plain."""
        return _longest_accepted_prefix(self, committed, candidate)


def _longest_accepted_prefix(accepts: Callable[[str, str], bool], committed: str, candidate: str) -> str:
    """Binary search for the longest prefix of ``candidate`` that ``accepts`` (prefix-closed) keeps."""
    lo, hi = 0, len(candidate)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if accepts(committed, candidate[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return candidate[:lo]


# -- streaming ----------------------------------------------------------------------------------
def _held_tag_prefix(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of the open tag."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def visible_content(text: str) -> str:
    """The answer text that is certain not to be tool-call markup, for streaming.

    Text inside a call (or after an unclosed one) and a tail that may open a call are held
    back; so are leading and trailing whitespace, and the whole answer while it may still be a
    bare JSON call (it starts with ``{``, ``[`` or a ```` ```json ```` fence).
    """
    pieces: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start == -1:
            tail = text[pos:]
            pieces.append(tail[: len(tail) - _held_tag_prefix(tail)])
            break
        pieces.append(text[pos:start])
        close = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if close == -1:
            break
        pos = close + len(TOOL_CALL_CLOSE)
    shown = "".join(pieces).lstrip()
    head = shown[:7]
    if shown.startswith(("{", "[")) or (head and ("```json".startswith(head) or shown.startswith("```json"))):
        return ""
    return shown.rstrip()


class ContentStream:
    """Turns growing committed text into append-only deltas of answer text."""

    def __init__(self) -> None:
        self.emitted = ""

    def feed(self, text: str) -> str:
        """New answer text, given everything committed (and safe to show) so far."""
        shown = visible_content(text)
        if not shown.startswith(self.emitted) or len(shown) <= len(self.emitted):
            return ""
        delta = shown[len(self.emitted) :]
        self.emitted = shown
        return delta

    def finish(self, content: str) -> str:
        """The rest of the final answer text."""
        if content.startswith(self.emitted):
            return content[len(self.emitted) :]
        return ""  # cannot happen with parse_tool_calls' content; never repeat text


# -- one request --------------------------------------------------------------------------------
def _format_schema(response_format: Mapping[str, Any]) -> Mapping[str, Any] | None:
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if isinstance(spec, Mapping):
            schema = spec.get("schema")
            if isinstance(schema, Mapping):
                return schema
        schema = response_format.get("schema")
        if isinstance(schema, Mapping):
            return schema
        raise InputError("response_format of type 'json_schema' needs json_schema.schema (a JSON-schema dict)")
    if kind == "json_object":
        schema = response_format.get("schema")
        return schema if isinstance(schema, Mapping) else None
    raise InputError(f"unknown response_format type {kind!r}: use 'json_object' or 'json_schema'")


JSON_INSTRUCTION = "Answer with a single JSON object and nothing else."
ANSWER_FROM_RESULTS = (
    "The results of the tools you called are in the conversation. Answer the user's question "
    "with them, in plain words. Do not call a tool again."
)
JSON_SCHEMA_INSTRUCTION = "Answer with a single JSON object that matches this JSON schema, and nothing else:\n{schema}"


CandidateFilter = Callable[[str, str], bool]


@dataclass(frozen=True)
class OutputPlan:
    """How one request handles tools and JSON output (built by :meth:`build`)."""

    tools: list[dict[str, Any]]
    """Normalized tool schemas to render (empty with ``tool_choice="none"``)."""
    choice: ToolChoice
    prefill: str = ""
    """Text committed before the first round (forces a call or a JSON object)."""
    choices: tuple[str, ...] = ()
    """Continuations of the prefill the verifiers vote on before the first round (the tool a
    forced call names, when several tools are given)."""
    constraint: CandidateFilter | None = None
    stop: tuple[str, ...] = ()
    """Extra stop strings (a forced call ends at its close tag)."""
    instruction: str | None = None
    """System text added to the conversation (JSON output)."""
    parse: bool = False
    """Parse tool calls out of the committed text."""

    @classmethod
    def build(
        cls,
        tools: Sequence[object] | None = None,
        tool_choice: object = None,
        response_format: Mapping[str, Any] | None = None,
        *,
        parallel_tool_calls: bool = False,
        answering: bool = False,
    ) -> OutputPlan | None:
        """Check the request's tools / tool_choice / response_format; ``None`` when there are none.

        ``tool_choice="none"`` hides the tools and keeps the answer plain text; ``answering``
        (with ``"none"``) also asks the members to answer from the tool results in the
        conversation (used when an answer only repeated calls already answered).

        Raises:
            InputError: a bad tool schema, an unknown ``tool_choice``, or a bad ``response_format``.
        """
        normalized = normalize_tools(tools)
        if tool_choice is not None and not normalized and tool_choice not in ("none", "auto"):
            raise InputError(f"tool_choice {tool_choice!r} was given without tools")
        choice = normalize_tool_choice(tool_choice, normalized)
        if response_format is not None:
            if not isinstance(response_format, Mapping):
                raise InputError(f"response_format must be a dict, got {type(response_format).__name__}")
            if normalized and choice.mode != "none":
                raise InputError("give either tools or response_format, not both")
            schema = _format_schema(response_format)
            instruction = (
                JSON_SCHEMA_INSTRUCTION.format(schema=json.dumps(schema, ensure_ascii=False))
                if response_format.get("type") == "json_schema" and schema
                else JSON_INSTRUCTION
            )
            is_object = schema is None or _types(_resolve(schema, schema)) in (None, {"object"})
            return cls(
                tools=[],
                choice=ToolChoice("none"),
                prefill="{" if is_object else "",
                constraint=JSONConstraint(schema),
                instruction=instruction,
            )
        if not normalized:
            return None
        if choice.mode == "none":
            return cls(
                tools=[],
                choice=choice,
                constraint=PlainTextConstraint(),
                instruction=ANSWER_FROM_RESULTS if answering else None,
            )
        single = not parallel_tool_calls or choice.mode == "required"
        prefill = ""
        choices: tuple[str, ...] = ()
        if choice.mode == "required":
            prefill = f'{TOOL_CALL_OPEN}\n{{"name": "'
            names = [choice.name] if choice.name is not None else [t["function"]["name"] for t in normalized]
            choices = tuple(f'{name}", "arguments": {{' for name in names)  # arguments are an object
            if len(choices) == 1:
                prefill, choices = prefill + choices[0], ()
        return cls(
            tools=normalized,
            choice=choice,
            prefill=prefill,
            choices=choices,
            constraint=ToolCallConstraint(normalized, single_call=single),
            stop=(TOOL_CALL_CLOSE,) if single else (),
            parse=True,
        )

    def combine(self, constraint: CandidateFilter | None) -> CandidateFilter | None:
        """This plan's constraint and the caller's, both required."""
        if constraint is None or self.constraint is None:
            return constraint or self.constraint
        mine = self.constraint
        return _Both(mine, constraint)

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add the JSON instruction to the system message (or a new one)."""
        if not self.instruction:
            return messages
        out = [dict(m) for m in messages]
        if out and out[0].get("role") in ("system", "developer"):
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{self.instruction}".strip()
        else:
            out.insert(0, {"role": "system", "content": self.instruction})
        return out

    def finish(self, result: GenerationResult) -> GenerationResult:
        """Attach content and parsed tool calls to the final result."""
        if not self.parse:
            return result
        parsed = parse_tool_calls(result.text, self.tools)
        finish = "tool_calls" if parsed.tool_calls else result.finish_reason
        return dataclasses.replace(
            result,
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            invalid_tool_calls=parsed.invalid_tool_calls,
            finish_reason=finish,
        )

    def wrap(
        self,
        events: Iterator[StreamEvent],
        messages: Sequence[Mapping[str, Any]] = (),
        answer_instead: Callable[[], Iterator[StreamEvent]] | None = None,
    ) -> Iterator[StreamEvent]:
        """Post-process a request's events: answer-text deltas, calls on the final event.

        With ``tool_choice="auto"``, an answer whose calls all repeat calls already answered in
        ``messages`` (same tool, same arguments) brings nothing new: when ``answer_instead`` is
        given, its events (a run without tools) replace the final event.
        """
        if not self.parse:
            yield from events
            return
        stream = ContentStream()
        text = ""
        for event in events:
            text += event.delta
            if event.done and event.result is not None:
                result = self.finish(event.result)
                if (
                    answer_instead is not None
                    and self.choice.mode == "auto"
                    and repeats_answered_calls(result.tool_calls, messages)
                ):
                    yield from answer_instead()
                    return
                delta = stream.finish(result.content or "")
                yield dataclasses.replace(event, delta=delta, result=result)
            else:
                yield dataclasses.replace(event, delta=stream.feed(text))


def _call_key(name: Any, arguments: Any) -> tuple[str, str]:
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return str(name), json.dumps(arguments, sort_keys=True, ensure_ascii=False, default=str)


def answered_calls(messages: Sequence[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """``(tool name, canonical JSON arguments)`` of the assistant calls that got a tool result."""
    answered_ids = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    has_results = any(m.get("role") == "tool" for m in messages)
    keys: set[tuple[str, str]] = set()
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, Mapping) else {}
            if not isinstance(fn, Mapping):
                continue
            call_id = call.get("id") if isinstance(call, Mapping) else None
            if call_id in answered_ids or (call_id is None and has_results):
                keys.add(_call_key(fn.get("name"), fn.get("arguments", {})))
    return keys


def repeats_answered_calls(calls: Sequence[ToolCall], messages: Sequence[Mapping[str, Any]]) -> bool:
    """True when there are calls and each repeats a call already answered in ``messages``."""
    if not calls:
        return False
    answered = answered_calls(messages)
    return all(_call_key(c.name, c.arguments) in answered for c in calls)


@dataclass(frozen=True)
class _Both:
    first: CandidateFilter
    second: CandidateFilter

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.first(committed, candidate) and self.second(committed, candidate)

    def trim(self, committed: str, candidate: str) -> str:
        trim = getattr(self.first, "trim", None)
        out = trim(committed, candidate) if trim else candidate
        return out if self.second(committed, out) else ""

    def options(self, committed: str) -> list[str]:
        options = getattr(self.first, "options", None)
        return [o for o in (options(committed) if options else []) if self.second(committed, o)]
