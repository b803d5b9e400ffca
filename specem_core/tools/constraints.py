"""Constraints that keep a segment a valid prefix while the ensemble generates it.

What a constraint is, typed: :class:`CandidateFilter` (the protocol every ``constraint=`` is:
``constraint(committed, candidate) -> keep?``), its optional methods as protocols of their own
(:class:`TrimmingFilter`, :class:`ListingFilter`, :class:`CompletingFilter`), and
:class:`Constraint`, the base class with every optional method (defaults that do nothing) that
the engine works with: :func:`as_constraint` wraps any other filter in one.

The constraints, built on :class:`~specem_core.tools.json_prefix.JSONPrefixParser` (a JSON
parser that accepts any prefix of a valid document and checks a JSON schema on the way), are
:class:`Constraint` s:

* :class:`ToolCallConstraint`: once a call has started, only candidates that keep it a valid JSON
  *prefix* of a call to a known tool with arguments fitting the schema stay in the vote (property
  names, required properties before an object closes, JSON value kinds, string enums). Its
  :meth:`~ToolCallConstraint.trim` cuts a candidate back to its longest acceptable prefix when
  every candidate breaks the call.
* :class:`JSONConstraint`: a whole JSON answer fitting a schema (``response_format``).
* :class:`PlainTextConstraint`: an answer that is neither a call nor JSON (``tool_choice="none"``).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from specem_core.tools.json_prefix import JSONPrefixParser, PrefixIncomplete, PrefixInvalid
from specem_core.tools.parse import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    call_regions,
    tool_index,
)


class CandidateFilter(Protocol):
    """``constraint(committed_text, candidate_text) -> keep?`` — e.g. keep a started tool call
    parseable. When it rejects every candidate of a round, all of them stay in the vote. A plain
    function is one; the engine also uses the optional methods of :class:`TrimmingFilter`,
    :class:`ListingFilter` and :class:`CompletingFilter` when a filter has them (a
    :class:`Constraint` has all three)."""

    def __call__(self, committed: str, candidate: str, /) -> bool: ...


@runtime_checkable
class TrimmingFilter(CandidateFilter, Protocol):
    """A :class:`CandidateFilter` that can cut a rejected candidate back to what it accepts."""

    def trim(self, committed: str, candidate: str) -> str:
        """The longest acceptable prefix of ``candidate`` after ``committed`` (``""``: none)."""
        ...


@runtime_checkable
class ListingFilter(CandidateFilter, Protocol):
    """A :class:`CandidateFilter` that can list the continuations it accepts."""

    def options(self, committed: str) -> list[str]:
        """The continuations of ``committed``, when they can be listed (voted on when no
        candidate fits); empty otherwise."""
        ...


@runtime_checkable
class CompletingFilter(CandidateFilter, Protocol):
    """A :class:`CandidateFilter` that knows when the answer is a whole document."""

    def complete(self, text: str) -> bool:
        """Whether ``text`` (the committed answer) is whole: the engine ends it there with ``stop``."""
        ...


class Constraint(ABC):
    """A :class:`CandidateFilter` with every optional method; the defaults do nothing (no trim,
    no options, never complete). Every constraint of this package is one."""

    @abstractmethod
    def __call__(self, committed: str, candidate: str) -> bool:
        """Whether ``candidate`` may follow ``committed``."""

    def trim(self, committed: str, candidate: str) -> str:
        """The longest acceptable prefix of ``candidate`` (none by default: ``""``)."""
        return ""

    def options(self, committed: str) -> list[str]:
        """The continuations of ``committed`` that can be listed (none by default)."""
        return []

    def complete(self, text: str) -> bool:
        """Whether the answer ``text`` is a whole document (never, by default)."""
        return False


class _Wrapped(Constraint):
    """Any :class:`CandidateFilter` as a :class:`Constraint`: its optional methods where it has
    them, the defaults where not."""

    def __init__(self, inner: CandidateFilter) -> None:
        self.inner = inner

    def __call__(self, committed: str, candidate: str) -> bool:
        return bool(self.inner(committed, candidate))

    def trim(self, committed: str, candidate: str) -> str:
        return self.inner.trim(committed, candidate) if isinstance(self.inner, TrimmingFilter) else ""

    def options(self, committed: str) -> list[str]:
        return list(self.inner.options(committed)) if isinstance(self.inner, ListingFilter) else []

    def complete(self, text: str) -> bool:
        return bool(self.inner.complete(text)) if isinstance(self.inner, CompletingFilter) else False


def as_constraint(constraint: CandidateFilter) -> Constraint:
    """``constraint`` itself when it is a :class:`Constraint`, else wrapped in one."""
    return constraint if isinstance(constraint, Constraint) else _Wrapped(constraint)


def _check_call_text(body: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[bool, int | None]:
    """(valid prefix?, end of the call object or ``None`` while it is still open)."""
    parser = JSONPrefixParser(body)
    try:
        parser.ws()
        if parser.i >= len(body):
            return True, None
        parser.call(tools)
    except PrefixIncomplete:
        return True, None
    except PrefixInvalid:
        return False, None
    return True, parser.i


class ToolCallConstraint(Constraint):
    """Keeps started tool calls parseable (a :class:`Constraint`).

    ``constraint(committed, candidate)`` is true when every ``<tool_call>`` region that
    ``committed + candidate`` touches beyond ``committed`` is a valid prefix of
    ``<tool_call>{"name": <a given tool>, "arguments": <fits its schema>}</tool_call>``. Text
    outside calls is free. With ``single_call`` nothing may follow a closed call but whitespace;
    otherwise only whitespace or another call.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]], *, single_call: bool = False) -> None:
        self._tools = tool_index(tools)
        self._single = single_call

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.accepts(committed + candidate, len(committed))

    def accepts(self, text: str, start: int = 0) -> bool:
        """Whether ``text`` is acceptable, looking only at what reaches past ``start``."""
        spans, bodies = call_regions(text)
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
        spans, bodies = call_regions(committed)
        if not spans or spans[-1][1] != len(committed):
            return []
        body = bodies[-1]
        if committed.endswith(TOOL_CALL_CLOSE) or not self.accepts(committed, spans[-1][0]):
            return []
        parser = JSONPrefixParser(body)
        try:
            parser.end_or("{")
            parser.call(self._tools)
        except PrefixIncomplete as exc:
            return exc.options
        except PrefixInvalid:
            return []
        rest = body[parser.i :].lstrip()
        return [TOOL_CALL_CLOSE[len(rest) :]] if TOOL_CALL_CLOSE.startswith(rest) else []

    def trim(self, committed: str, candidate: str) -> str:
        """The longest prefix of ``candidate`` that keeps ``committed + prefix`` acceptable."""
        return _longest_accepted_prefix(self, committed, candidate)


class JSONConstraint(Constraint):
    """Keeps a whole JSON answer a valid prefix of a JSON object fitting ``schema``.

    A :class:`Constraint` for ``response_format``; leading whitespace is
    allowed, trailing text after the closed object is not.
    """

    def __init__(self, schema: Mapping[str, Any] | None = None) -> None:
        self._schema = dict(schema) if schema else {"type": "object"}

    def __call__(self, committed: str, candidate: str) -> bool:
        return self.accepts(committed + candidate)

    def _state(self, text: str) -> str:
        """``"prefix"`` (empty or unfinished), ``"complete"`` (a whole object, then only
        whitespace) or ``"invalid"``."""
        parser = JSONPrefixParser(text, self._schema, strict=True)
        try:
            parser.ws()
            if parser.i >= len(text):
                return "prefix"
            parser.value(self._schema)
        except PrefixIncomplete:
            return "prefix"
        except PrefixInvalid:
            return "invalid"
        return "complete" if not text[parser.i :].strip() else "invalid"

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is a prefix of a JSON object fitting the schema."""
        return self._state(text) != "invalid"

    def complete(self, text: str) -> bool:
        """Whether ``text`` is a whole JSON object fitting the schema (only whitespace may follow
        it, so the answer is over: the engine ends it with ``stop``)."""
        return self._state(text) == "complete"

    def forced(self, committed: str) -> str:
        """The only valid continuation of the JSON answer at the end of ``committed``, if any."""
        options = self.options(committed)
        return options[0] if len(options) == 1 else ""

    def options(self, committed: str) -> list[str]:
        """The continuations of the JSON answer at the end of ``committed``, when they can be listed."""
        if not self.accepts(committed):
            return []
        parser = JSONPrefixParser(committed, self._schema, strict=True)
        try:
            parser.value(self._schema)
        except PrefixIncomplete as exc:
            return exc.options
        except PrefixInvalid:
            return []
        return []

    def trim(self, committed: str, candidate: str) -> str:
        """The longest prefix of ``candidate`` that keeps the answer acceptable."""
        return _longest_accepted_prefix(self, committed, candidate)


class PlainTextConstraint(Constraint):
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


BARE_CALL_RE = re.compile(r'\{\s*"|\[\s*\{')
"""The start of a JSON object with a key, or of an array of objects, anywhere in a text: how a
bare JSON tool call (``{"name": ...``) begins, and never words."""


class AnswerConstraint(PlainTextConstraint):
    """The words of a final answer after tool results (the answer that replaces a repeated call,
    or the one after the tool-round limit): no call markup and no bare call JSON anywhere.

    When every candidate of the first round is a call, :meth:`options` offers ``opener`` (the
    members then go on in words); :meth:`complete` ends the answer as soon as call JSON is
    committed anyway (``OutputPlan`` cuts it off and falls back to the tool results).
    """

    def __init__(self, opener: str = "The result is") -> None:
        self.opener = opener

    def accepts(self, text: str) -> bool:
        """Whether ``text`` holds words only: no call and no JSON answer."""
        return super().accepts(text) and BARE_CALL_RE.search(text) is None

    def options(self, committed: str) -> list[str]:
        """``[opener]`` before any text; nothing afterwards."""
        return [self.opener] if not committed.strip() else []

    def complete(self, text: str) -> bool:
        """The committed text started a call: nothing after it belongs to the answer."""
        return not self.accepts(text)

    def trim(self, committed: str, candidate: str) -> str:
        """The longest acceptable prefix of ``candidate``, less a tail that may open a call
        (from its last ``{``, ``[``, ``<`` or backtick on)."""
        cut = _longest_accepted_prefix(self, committed, candidate)
        start = max(cut.rfind(ch) for ch in "{[<`")
        return cut[:start] if start != -1 else cut


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
