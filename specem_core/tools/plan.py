"""One request's output plan: tools, prefill and constraint in; answer text and calls out.

* :class:`OutputPlan` puts it together for one request: which tools to render, a *prefill* (text
  committed before the first round) that forces a call for ``tool_choice="required"`` or a named
  tool, the constraint, and the post-processing of stream events.
* ``response_format`` (``{"type": "json_object"}`` or ``{"type": "json_schema", ...}``) gets the
  same treatment for plain JSON answers: an instruction, a ``{`` prefill and a schema constraint.
* :func:`visible_content` / :class:`ContentStream`: the answer text that is safe to stream (never
  tool-call markup).
* :func:`answered_calls` / :func:`repeats_answered_calls`: the calls a conversation already answered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specem_core.errors import InputError
from specem_core.tools._jsonschema import resolve_refs, schema_types
from specem_core.tools.constraints import (
    BARE_CALL_RE,
    AnswerConstraint,
    CandidateFilter,
    Constraint,
    JSONConstraint,
    PlainTextConstraint,
    ToolCallConstraint,
    as_constraint,
)
from specem_core.tools.parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from specem_core.tools.schema import ToolChoice, normalize_tool_choice, normalize_tools
from specem_core.types import GenerationResult, StreamEvent, ToolCall


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


def answer_words(text: str) -> str:
    """The words of a final answer after tool results: ``text`` up to the first call markup or
    bare call JSON; empty when it starts as a call or a JSON answer."""
    head = text.strip()
    if head.startswith(PlainTextConstraint.MARKERS):
        return ""
    cuts = [i for i in (head.find(TOOL_CALL_OPEN), head.find("```json")) if i != -1]
    match = BARE_CALL_RE.search(head)
    if match:
        cuts.append(match.start())
    return head[: min(cuts)].rstrip() if cuts else head


_HELD_TAIL = 24
"""How far back from the end :func:`visible_answer` looks for a ``{``, ``[``, ``<`` or a
backtick that may start call markup."""


def visible_answer(text: str) -> str:
    """The part of :func:`answer_words` that is safe to stream: a tail that may still become a
    call (from a recent ``{``, ``[``, ``<`` or backtick on) is held back."""
    words = answer_words(text)
    tail_start = max(0, len(words) - _HELD_TAIL)
    held = [words.rfind(ch, tail_start) for ch in "{[<`"]
    cut = max(held)
    return (words[:cut] if cut != -1 else words).rstrip()


def tool_results_summary(messages: Sequence[Mapping[str, Any]], limit: int = 300) -> str:
    """A short answer stating the last tool results in ``messages`` (the fallback when the
    members write nothing but calls where words are due)."""
    results: list[str] = []
    for m in reversed(messages):
        role = m.get("role")
        if role == "tool":
            text = " ".join(str(m.get("content") or "").split())
            results.append(text[:limit].rstrip(".") or "empty")
        elif results or role in ("user", "assistant"):
            break
    if not results:
        return "I could not find the answer with the tools."
    results.reverse()
    if len(results) == 1:
        return f"The result is {results[0]}."
    return f"The results are {', '.join(results)}."


def tool_rounds(messages: Sequence[Mapping[str, Any]]) -> int:
    """Assistant turns with tool calls since the last user message (one agent step each)."""
    rounds = 0
    for m in reversed(messages):
        if m.get("role") == "user":
            break
        if m.get("role") == "assistant" and m.get("tool_calls"):
            rounds += 1
    return rounds


MAX_TOOL_ROUNDS = 8
"""Tool rounds (assistant turns with calls since the last user message) after which a request
with ``tool_choice="auto"`` is answered in words from the tool results, without tools: an agent
loop always ends, well within LangGraph's old recursion limit of 25 and LlamaIndex
``FunctionAgent``'s ``max_iterations=20``."""


class ContentStream:
    """Turns growing committed text into append-only deltas of answer text."""

    def __init__(self, visible: Callable[[str], str] = visible_content) -> None:
        self.emitted = ""
        self.visible = visible

    def feed(self, text: str) -> str:
        """New answer text, given everything committed (and safe to show) so far."""
        shown = self.visible(text)
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
ANSWER_FROM_RESULTS = (  # an imperative: small models echoed a statement ("The result is in the conversation.")
    "Answer the user's question now, in plain words, from the tool results above. Do not call a tool again."
)
JSON_SCHEMA_INSTRUCTION = "Answer with a single JSON object that matches this JSON schema, and nothing else:\n{schema}"


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
    constraint: Constraint | None = None
    """The candidate filter of the plan (a tool call's, a JSON answer's, plain text's)."""
    stop: tuple[str, ...] = ()
    """Extra stop strings (a forced call ends at its close tag)."""
    instruction: str | None = None
    """System text added to the conversation (JSON output)."""
    parse: bool = False
    """Parse tool calls out of the committed text."""
    answering: bool = False
    """A final answer in words from the tool results: call markup or JSON is cut off, and an
    answer left empty becomes :func:`tool_results_summary`."""

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
            is_object = schema is None or schema_types(resolve_refs(schema, schema)) in (None, {"object"})
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
                constraint=AnswerConstraint() if answering else PlainTextConstraint(),
                instruction=ANSWER_FROM_RESULTS if answering else None,
                answering=answering,
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

    def combine(self, constraint: CandidateFilter | None) -> Constraint | None:
        """This plan's constraint and the caller's, both required."""
        if constraint is None:
            return self.constraint
        theirs = as_constraint(constraint)
        return theirs if self.constraint is None else _Both(self.constraint, theirs)

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add the instruction (JSON output, or answering from the tool results when there are
        some) to the system message (or a new one)."""
        if not self.instruction or (self.answering and not any(m.get("role") == "tool" for m in messages)):
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
        call_instead: Callable[[], Iterator[StreamEvent]] | None = None,
    ) -> Iterator[StreamEvent]:
        """Post-process a request's events: answer-text deltas, calls on the final event.

        With ``tool_choice="auto"``, an answer whose calls all repeat calls already answered in
        ``messages`` (same tool, same arguments) brings nothing new, one that applies the last
        call again to that call's own result loops (:func:`reapplies_last_call`), and after tool results an
        answer that is empty, or has only unparseable calls or call JSON as content, would end the
        loop on junk or on nothing: when ``answer_instead`` is given, its events (a run without
        tools) replace the final event. An answer that is only bare call JSON the parser cannot
        read (naming a given tool, e.g. with an expression as an argument) is replaced by
        ``call_instead``'s events (a constrained call the framework can run), and so is one that
        is only invalid ``<tool_call>`` blocks when the retry writes a call that parses; one that is
        only a call to a tool nobody gave (``{"name": "days_in_week", "arguments": ...}``) by
        ``answer_instead``'s (words).
        """
        if self.answering:
            yield from self._answer(events, messages)
            return
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
                    and (
                        repeats_answered_calls(result.tool_calls, messages)
                        or reapplies_last_call(result.tool_calls, messages)
                        or _unusable_final(result, messages)
                    )
                ):
                    yield from answer_instead()
                    return
                unread = _unread_call(result, self.tools) if self.choice.mode == "auto" else None
                instead = {"call": call_instead, "words": answer_instead}.get(unread or "")
                if instead is not None and not result.invalid_tool_calls:
                    yield from instead()
                    return
                final = dataclasses.replace(event, delta=stream.finish(result.content or ""), result=result)
                if instead is not None:  # invalid calls only: the retry's call, if it wrote one that parses
                    retried = list(instead())  # a call streams no text: nothing is held back
                    done = retried[-1].result if retried else None
                    yield from retried if done is not None and done.tool_calls else [final]
                    return
                yield final
            else:
                yield dataclasses.replace(event, delta=stream.feed(text))

    def _answer(self, events: Iterator[StreamEvent], messages: Sequence[Mapping[str, Any]]) -> Iterator[StreamEvent]:
        """An answering run's events: words only, never a call; the tool results when no words."""
        stream = ContentStream(visible_answer)
        text = ""
        for event in events:
            text += event.delta
            if event.done and event.result is not None:
                words = answer_words(event.result.text)
                opener = self.constraint.opener if isinstance(self.constraint, AnswerConstraint) else None
                if not words or (opener and words.rstrip(" .:,") == opener):
                    words = tool_results_summary(messages)
                result = dataclasses.replace(event.result, content=words, tool_calls=[], invalid_tool_calls=[])
                yield dataclasses.replace(event, delta=stream.finish(words), result=result)
            else:
                yield dataclasses.replace(event, delta=stream.feed(text))


def _unusable_final(result: GenerationResult, messages: Sequence[Mapping[str, Any]]) -> bool:
    """After tool results, an answer with no call a framework can run that is empty, or whose
    content is call JSON that did not parse (e.g. ``{{"name": ...}}``), or that holds only invalid
    calls: it would end the agent loop on junk or on an empty message."""
    if result.tool_calls or not tool_rounds(messages):
        return False
    content = (result.content or "").strip()
    return not content or bool(result.invalid_tool_calls) or answer_words(content) != content


def _unread_call(result: GenerationResult, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """What an answer with no runnable call and no words needs, since it would end the loop on a
    raw call or on nothing: ``"call"`` when it is only bare or fenced call JSON naming one of
    ``tools`` that did not parse (``"b": 17 + 9``), or only ``<tool_call>`` blocks naming given
    tools that are invalid (``"b": 4 * 3``: the framework gets no call and an empty message);
    ``"words"`` when it calls a tool nobody gave; ``None`` for anything else. (When the
    constrained retry of invalid calls writes no call that parses either, the first answer's
    invalid calls are reported in ``invalid_tool_calls``, as LangChain expects.)"""
    if result.tool_calls:
        return None
    content = (result.content or "").strip()
    given = {t["function"]["name"] for t in tools}
    if result.invalid_tool_calls:
        invalid_only = not answer_words(content) and all(c.name in given for c in result.invalid_tool_calls)
        return "call" if invalid_only else None
    if not content or answer_words(content):
        return None  # words, or nothing: an answer
    match = _CALL_NAME_RE.search(content)
    if match is None:
        return None
    if match.group(1) in given:
        return "call"
    return "words" if _CALL_ARGUMENTS_RE.search(content) else None  # call-shaped, not any JSON with a name


_CALL_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
_CALL_ARGUMENTS_RE = re.compile(r'"(?:arguments|parameters)"\s*:')


def _message_call(call: Any) -> tuple[str, Any] | None:
    """(name, arguments) of a call in an assistant message (OpenAI or flat shape), arguments
    parsed when they are a JSON string; ``None`` when it is not a call object."""
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        return None
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return str(fn.get("name")), arguments


def _call_key(name: Any, arguments: Any) -> tuple[str, str]:
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
            parts = _message_call(call)
            if parts is None:
                continue
            call_id = call.get("id")
            if call_id in answered_ids or (call_id is None and has_results):
                keys.add(_call_key(*parts))
    return keys


def repeats_answered_calls(calls: Sequence[ToolCall], messages: Sequence[Mapping[str, Any]]) -> bool:
    """True when there are calls and each repeats a call already answered in ``messages``."""
    if not calls:
        return False
    answered = answered_calls(messages)
    return all(_call_key(c.name, c.arguments) in answered for c in calls)


def reapplies_last_call(calls: Sequence[ToolCall], messages: Sequence[Mapping[str, Any]]) -> bool:
    """True when ``calls`` is one call that repeats the conversation's last call with its result
    put in place of one argument, all other arguments the same: ``add(a=84, b=5)`` → ``89``, then
    ``add(a=89, b=5)``; ``convert(26.2, "miles", "km")`` → ``42.16``, then ``convert(42.16, "miles",
    "km")``. Small models loop this way after a multi-step question ("12 times 7, plus 5"), each call
    new, until the round limit; the answer is due after the first result.

    A task that really applies one step to its own result again (compound interest as repeated
    multiplications by the same rate) is cut short by this rule: such a loop is answered from the
    results so far. Tool results that are not a single value (JSON objects, text) never match."""
    if len(calls) != 1:
        return False
    last = _last_call_and_result(messages)
    if last is None:
        return False
    (name, previous), result = last
    args = calls[0].arguments
    if calls[0].name != name or not isinstance(previous, Mapping) or set(args) != set(previous):
        return False
    changed = [key for key in args if not _same_value(args[key], previous[key], tolerance=0.0)]
    return len(changed) == 1 and _same_value(args[changed[0]], result)


def _last_call_and_result(messages: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, Any], str] | None:
    """((name, arguments), result text) of the last assistant turn when it made exactly one call
    and the messages after it are that call's result alone."""
    for n in range(len(messages) - 1, -1, -1):
        m = messages[n]
        if m.get("role") == "tool":
            continue
        if m.get("role") != "assistant" or len(m.get("tool_calls") or []) != 1:
            return None
        results = messages[n + 1 :]
        if len(results) != 1:
            return None
        parts = _message_call(m["tool_calls"][0])
        return None if parts is None else (parts, str(results[0].get("content") or ""))
    return None


def _same_value(value: Any, other: Any, tolerance: float = 0.01) -> bool:
    """Equal as numbers (within ``tolerance``, relative, and as much absolute: a model often rounds
    a result it copies), else as text."""
    try:
        a, b = float(str(value).strip()), float(str(other).strip())
    except ValueError:
        return str(value).strip() == str(other).strip()
    return abs(a - b) <= max(tolerance, tolerance * max(abs(a), abs(b)))


@dataclass(frozen=True)
class _Both(Constraint):
    """The plan's constraint (``first``: it trims and lists options) and the caller's (``second``:
    it only checks them)."""

    first: Constraint
    second: Constraint

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.first(committed, candidate) and self.second(committed, candidate)

    def trim(self, committed: str, candidate: str) -> str:
        out = self.first.trim(committed, candidate)
        return out if self.second(committed, out) else ""

    def options(self, committed: str) -> list[str]:
        return [o for o in self.first.options(committed) if self.second(committed, o)]

    def complete(self, text: str) -> bool:
        return self.first.complete(text) or self.second.complete(text)
