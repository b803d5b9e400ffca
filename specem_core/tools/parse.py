"""Lenient parsing of tool calls and JSON out of committed text.

The ensemble writes tool calls in one canonical syntax (see :mod:`specem_core.tools`): a JSON call
object between :data:`TOOL_CALL_OPEN` and :data:`TOOL_CALL_CLOSE`.

* :func:`parse_tool_calls` turns committed text into answer text, :class:`~specem_core.types.ToolCall` s
  (with ids and arguments coerced to the tool's JSON schema) and
  :class:`~specem_core.types.InvalidToolCall` s. Bare JSON answers such as
  ``{"name": ..., "arguments": ...}`` are accepted too. It never raises on model output.
* :func:`loads_lenient` reads a JSON value that is fenced, followed by text, or cut short.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specem_core.tools._jsonschema import json_type
from specem_core.tools.schema import coerce_arguments, normalize_tools
from specem_core.types import InvalidToolCall, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_LISTING_OPEN = "<tools>"
"""The tag Qwen2.5's and Hermes' chat templates list the offered tools under, in the prompt."""

ARGUMENT_KEYS = ("arguments", "parameters")
"""The keys a call object may hold its arguments under."""
CALL_KEYS = ("name", *ARGUMENT_KEYS)
"""The keys of a call object."""
_FENCE_RE = re.compile(r"^```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?[ \t]*(```)?\s*$", re.DOTALL)


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


def call_regions(text: str) -> tuple[list[tuple[int, int]], list[str]]:
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


_CALL_FENCE_RE = re.compile(r"^```(?:json)?[ \t]*\n")


class _JsonScan:
    """The structural characters (``{ [ ] }``) of JSON text outside its strings; after the
    iteration, whether the text ended inside a string, and just after a backslash there."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.in_string = self.escape = False

    def __iter__(self) -> Iterator[str]:
        for ch in self.text:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[]}":
                yield ch


def _value_open(body: str) -> bool:
    """Whether the JSON value ``body`` starts with (``{`` or ``[``) is still open at its end."""
    depth = 0
    for ch in _JsonScan(body):
        depth += 1 if ch in "{[" else -1
        if depth <= 0:
            return False
    return True


def call_in_progress(text: str) -> bool:
    """Whether an answer ends inside a tool call it has started: a ``<tool_call>`` without its
    close tag, or an answer that began as call JSON (bare, or in a ```` ```json ```` fence) whose
    value is not closed yet. What follows a closed call is not part of it."""
    spans, _ = call_regions(text)
    if spans and not text[: spans[-1][1]].endswith(TOOL_CALL_CLOSE):
        return True
    head = text.lstrip()
    if head.startswith("```"):
        fence = _CALL_FENCE_RE.match(head)
        if fence is None:  # a fence still being opened counts once it names json
            return "\n" not in head and head[3:].strip().startswith("json")
        head = head[fence.end() :].lstrip()
    return head.startswith(("{", "[")) and _value_open(head)


def opens_call(text: str) -> bool:
    """Whether an answer's opening starts a tool call: call markup anywhere in it, or call JSON
    as its first non-space text (bare, an array, or in a code fence that names json or nothing; a
    fence whose first line is not complete yet counts while it may still name json). An empty
    opening starts nothing."""
    head = text.lstrip()
    if TOOL_CALL_OPEN in head:
        return True
    if head.startswith("```"):
        fence = _CALL_FENCE_RE.match(head)
        if fence is None:  # another language, or a first line not complete yet
            return "\n" not in head and "json".startswith(head[3:].strip())
        if "json" in head[: fence.end()]:
            return True
        head = head[fence.end() :].lstrip()
    return head.startswith(("{", "["))


def opens_tool_listing(text: str) -> bool:
    """Whether an answer's opening repeats the tool listing its prompt showed (it starts with
    :data:`TOOL_LISTING_OPEN`): neither words for the user nor a call."""
    return text.lstrip().startswith(TOOL_LISTING_OPEN)


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
    scan = _JsonScan(text)
    for ch in scan:
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
        else:
            if not stack or stack[-1] != ch:
                return None
            stack.pop()
    out = text
    if scan.in_string:
        out += "\\" if scan.escape else ""
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
    try:
        return _loads_prefix(body)
    except ValueError:
        if "{{" not in body:
            raise
    # ``{{"name": ...}}``: braces doubled as in a Python format string (how a call is written in
    # prompts built with str.format, which small models copy); read with single braces
    return _loads_prefix(body.replace("{{", "{").replace("}}", "}"))


def _loads_prefix(body: str) -> Any:
    """The first JSON object or array in ``body``: followed by text, or cut short and closed."""
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
    for key in (*ARGUMENT_KEYS, "args", "input"):
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
        error = f"arguments must be a JSON object, got {json_type(args)}"
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


def tool_index(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in normalize_tools(tools)} if tools else {}


def parse_tool_calls(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedResponse:
    """Split committed text into answer text, tool calls and invalid tool calls. Never raises.

    ``<tool_call>…</tool_call>`` regions (the close tag may be missing at the end) are calls;
    without any, an answer that is only a JSON call object (optionally fenced) naming a given
    tool is one too. Arguments are coerced to the tool's schema; calls that fail go to
    ``invalid_tool_calls`` with the reason. ``content`` is the text outside the calls, with
    leading whitespace removed (and trailing whitespace too when there are calls).
    """
    index = tool_index(tools)
    spans, bodies = call_regions(text)
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
