"""A JSON parser that accepts any prefix of a valid document and checks a JSON schema on the way:
what the constraints (:mod:`specem_core.tools.constraints`) decide a candidate segment with.

Reaching the end of the text raises :class:`PrefixIncomplete` (a valid prefix, with the
continuations that can be listed from there); a character no valid document could have raises
:class:`PrefixInvalid`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from specem_core.tools._jsonschema import resolve_refs, schema_types, schema_variants
from specem_core.tools.parse import ARGUMENT_KEYS, CALL_KEYS


class PrefixIncomplete(Exception):
    """The text ended inside a value: what was read is a valid prefix.

    ``options`` are the continuations a valid document can have from here when they can be
    listed (the remaining property names, the matching tool names or enum values, a closing
    brace…); empty when the next text is free (a string's content, a number)."""

    def __init__(self, *options: str, may_end: bool = False) -> None:
        super().__init__(*options)
        self.options = [o for o in dict.fromkeys(options) if o]
        self.may_end = may_end
        """The value read so far is complete (a number): what may follow it is an option too."""


class PrefixInvalid(Exception):
    """The text cannot be the prefix of a valid value."""


_NUMBER_PREFIX = re.compile(r"-?(0|[1-9]\d*)?(\.\d*)?([eE][+-]?\d*)?")
_NUMBER_FULL = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_INTEGER_PREFIX = re.compile(r"-?(0|[1-9]\d*)?")
JSON_SPACE = re.compile(r"(?: |(?:\r?\n){1,2}[ \t]{0,20})")
"""The whitespace a JSON answer (``strict``) may have between two tokens, as in llama.cpp's JSON
grammars (``common/json-schema-to-grammar.cpp``'s ``space`` rule): none, one space, or one or two
line ends and up to 20 spaces or tabs of indent. Unbounded runs let a small model write blank
lines until the token cap."""
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
    if schema_types(schema) == {"boolean"}:
        return ["true", "false"]
    return []


_OPENERS = {
    "string": ['"'],
    "object": ["{"],
    "array": ["["],
    "boolean": ["true", "false"],
    "null": ["null"],
    "integer": ["-", *"0123456789"],
    "number": ["-", *"0123456789"],
}


def _value_openers(types: set[str] | None) -> list[str]:
    """How a value of these JSON types can start (empty when any type goes)."""
    if not types:
        return []
    return list(dict.fromkeys(o for t in sorted(types) for o in _OPENERS.get(t, [])))


class JSONPrefixParser:
    """Recursive-descent JSON parser that accepts any prefix of a valid document.

    Reaching the end of the text raises :class:`PrefixIncomplete` (a valid prefix); a character that
    no valid document could have raises :class:`PrefixInvalid`. Schemas are checked on the way.
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
            raise PrefixIncomplete
        return self.s[self.i]

    def ws(self) -> None:
        """Skip whitespace between tokens; ``strict`` allows only llama.cpp's JSON-grammar run (see
        :data:`JSON_SPACE`), so a small model cannot fill a JSON answer with blank lines."""
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n":
            self.i += 1
        if self.strict and self.i > start:
            run = self.s[start : self.i]
            if not JSON_SPACE.fullmatch(run) and not (self.i == len(self.s) and run == "\r"):
                raise PrefixInvalid(f"whitespace {run!r} at {start}: a space, or 1-2 line ends and 0-20 of indent")

    def expect(self, ch: str) -> None:
        self.ws()
        if self.i >= len(self.s):
            raise PrefixIncomplete(ch)
        if self.s[self.i] != ch:
            raise PrefixInvalid(f"expected {ch!r} at {self.i}")
        self.i += 1

    def end_or(self, *options: str) -> None:
        """At the end of the text, stop here with these continuations as the options."""
        self.ws()
        if self.i >= len(self.s):
            raise PrefixIncomplete(*options)

    def string(
        self, allowed: Sequence[str] | None = None, pattern: re.Pattern[str] | None = None, after: str = ""
    ) -> str:
        """A JSON string; with ``allowed`` its value must be (a prefix of, while open) one of them;
        with ``pattern`` its value so far must match it (a prefix pattern). ``after`` is what
        must follow the string (used for the forced continuation)."""
        if allowed is not None:
            self.end_or(*(f'"{a}"{after}' for a in allowed))  # skips the whitespace too
        else:
            self.ws()  # an open object's next key, after ", "
        if self.peek() != '"':
            raise PrefixInvalid("expected a string")
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s):
                so_far = "".join(out)
                matches = [a for a in allowed if a.startswith(so_far)] if allowed is not None else None
                if matches is not None and not matches:
                    raise PrefixInvalid("string is not a prefix of an allowed value")
                if matches is not None:
                    raise PrefixIncomplete(*(f'{m[len(so_far) :]}"{after}' for m in matches))
                raise PrefixIncomplete
            ch = self.s[self.i]
            if ch == '"':
                self.i += 1
                value = "".join(out)
                if allowed is not None and value not in allowed:
                    raise PrefixInvalid(f"{value!r} is not one of {list(allowed)}")
                return value
            if ch == "\\":
                out.append(self._escape())
                continue
            out.append(ch)
            self.i += 1
            if allowed is not None and not any(a.startswith("".join(out)) for a in allowed):
                raise PrefixInvalid("string is not a prefix of an allowed value")
            if pattern is not None and not pattern.fullmatch("".join(out)):
                raise PrefixInvalid("string cannot become a value of the schema's type")

    def _escape(self) -> str:
        self.i += 1
        ch = self.peek()
        simple = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
        if ch in simple:
            self.i += 1
            return simple[ch]
        if ch != "u":
            raise PrefixInvalid("bad escape")
        self.i += 1
        digits = self.s[self.i : self.i + 4]
        if not re.fullmatch(r"[0-9a-fA-F]*", digits):
            raise PrefixInvalid("bad \\u escape")
        if len(digits) < 4:
            raise PrefixIncomplete
        self.i += 4
        return chr(int(digits, 16))

    def number(self, *, integer: bool = False) -> None:
        """A JSON number; with ``integer`` no fraction or exponent."""
        m = (_INTEGER_PREFIX if integer else _NUMBER_PREFIX).match(self.s, self.i)
        end = m.end() if m else self.i
        if end == len(self.s):
            if end == self.i and self.s[self.i : self.i + 1] != "-":
                raise PrefixInvalid("expected a number")
            # a number can always grow; a complete one may also end here
            raise PrefixIncomplete(may_end=bool(_NUMBER_FULL.fullmatch(self.s, self.i, end)))
        if not _NUMBER_FULL.fullmatch(self.s, self.i, end):
            raise PrefixInvalid("malformed number")
        self.i = end

    def literal(self) -> str:
        word, kind = _LITERALS[self.peek()]
        got = self.s[self.i : self.i + len(word)]
        if not word.startswith(got):
            raise PrefixInvalid("bad literal")
        if len(got) < len(word):
            raise PrefixIncomplete
        self.i += len(word)
        return kind

    # values with schemas
    def value(self, schema: Any = None) -> None:
        schema = resolve_refs(schema, self.root) if schema else {}
        self.end_or(*self._start_options(schema))
        ch = self.peek()
        variants = schema_variants(schema) if isinstance(schema, Mapping) else None
        types = schema_types(schema) if isinstance(schema, Mapping) and schema and variants is None else None
        if variants is not None:
            kinds: set[str] = set()
            for v in variants:
                t = schema_types(resolve_refs(v, self.root))
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
            max_items = schema.get("maxItems") if isinstance(schema, Mapping) else None
            self.arr(
                schema.get("items") if isinstance(schema, Mapping) else None,
                max_items if isinstance(max_items, int) and not isinstance(max_items, bool) else None,
            )
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
            raise PrefixInvalid(f"unexpected {ch!r}")

    def _start_options(self, schema: Any) -> list[str]:
        """How a value of ``schema`` can start, where that can be listed (enums, booleans; in a
        JSON answer, which is returned as written, also the opening character of its type: the
        ensemble takes one of these when every candidate writes a value of another type)."""
        options = _value_options(schema)
        if not options and self.strict and isinstance(schema, Mapping) and schema_variants(schema) is None:
            options = _value_openers(schema_types(schema))
        return options

    def value_then(self, schema: Any, after: Sequence[str]) -> None:
        """:meth:`value`; when the text ends in a value that may also end there, what may follow
        it (``after``) is offered as an option."""
        try:
            self.value(schema)
        except PrefixIncomplete as exc:
            if exc.may_end and not exc.options:
                raise PrefixIncomplete(*after) from exc
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
            raise PrefixInvalid(f"unexpected {ch!r}")

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
            raise PrefixInvalid(f"a value starting with {ch!r} cannot be {' or '.join(sorted(types))}")

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
                raise PrefixInvalid(f"missing required {required}")
            self.i += 1
            return
        while True:
            allowed = [p for p in props if p not in seen] if closed else None
            if closed or any(r not in seen for r in required):
                self.end_or(*_key_options(props, closed, required, seen, closing=False))
            key = self.string(allowed, after=": ")
            if key in seen:
                raise PrefixInvalid(f"repeated key {key!r}")
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
                    raise PrefixInvalid("no property left")
                continue
            if ch == "}":
                missing = [r for r in required if r not in seen]
                if missing:
                    raise PrefixInvalid(f"missing required {missing}")
                self.i += 1
                return
            raise PrefixInvalid(f"expected ',' or '}}' at {self.i}")

    def arr(self, items: Any, max_items: int | None = None) -> None:
        """An array; with ``max_items`` (the schema's ``maxItems``) it closes after that many."""
        self.expect("[")
        if max_items is not None and max_items <= 0:
            self.end_or("]")
            if self.peek() != "]":
                raise PrefixInvalid("the array must be empty (maxItems)")
        first = self._start_options(resolve_refs(items, self.root) if items else {})
        self.end_or(*first, *(["]"] if first else []))
        if self.peek() == "]":
            self.i += 1
            return
        count = 0
        while True:
            count += 1
            after = ["]"] if max_items is not None and count >= max_items else [", ", "]"]
            self.value_then(items, after)
            self.end_or(*after)
            ch = self.peek()
            if ch == "," and len(after) == 1:
                raise PrefixInvalid(f"more than maxItems={max_items} items")
            if ch == ",":
                self.i += 1
                continue
            if ch == "]":
                self.i += 1
                return
            raise PrefixInvalid(f"expected ',' or ']' at {self.i}")

    def call(self, tools: Mapping[str, Mapping[str, Any]]) -> None:
        """A Hermes call object ``{"name": <tool>, "arguments": {...}}`` (keys in any order)."""
        self.expect("{")
        name: str | None = None
        seen: set[str] = set()
        deferred_args: str | None = None
        while True:
            has_args = bool(seen & set(ARGUMENT_KEYS))
            allowed = [k for k in CALL_KEYS if k not in seen and not (k in ARGUMENT_KEYS and has_args)]
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
            done = name is not None and bool(seen & set(ARGUMENT_KEYS))
            optional = name is not None and not (tools[name].get("parameters") or {}).get("required")
            self.end_or(*(["}"] if done else [", ", "}"] if optional else [", "]))
            ch = self.peek()
            if ch == ",":
                if done:
                    raise PrefixInvalid("the call has a name and arguments already")
                self.i += 1
                continue
            if ch == "}":
                if name is None:
                    raise PrefixInvalid("the call has no name")
                params = tools[name].get("parameters") or {}
                if not seen & set(ARGUMENT_KEYS) and params.get("required"):
                    raise PrefixInvalid("the call has no arguments")
                self.i += 1
                return
            raise PrefixInvalid(f"expected ',' or '}}' at {self.i}")

    def _check_arguments(self, text: str, tool: Mapping[str, Any]) -> None:
        sub = JSONPrefixParser(text.strip(), tool.get("parameters") or {})
        try:
            if sub.s.startswith('"'):
                return
            sub.value(tool.get("parameters") or {})
        except PrefixIncomplete as exc:
            raise PrefixInvalid("truncated arguments") from exc
