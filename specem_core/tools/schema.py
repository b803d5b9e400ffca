"""Tool schemas and JSON schemas: OpenAI-style tools and ``tool_choice`` in, coerced arguments out.

* :func:`normalize_tools` / :func:`normalize_tool_choice` check OpenAI-style tool schemas and
  ``tool_choice`` values (bad input raises :class:`~specem_core.errors.InputError`).
* :func:`coerce_arguments` fits a call's arguments to its tool's JSON schema (``"7"`` → ``7`` for an
  integer), with the JSON-schema helpers of :mod:`specem_core.tools._jsonschema`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from specem_core.errors import InputError
from specem_core.tools._jsonschema import json_type, resolve_refs, schema_types, schema_variants

ToolChoiceMode = Literal["auto", "none", "required"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


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
    schema = resolve_refs(schema, root)
    if not isinstance(schema, Mapping) or not schema:
        return value
    variants = schema_variants(schema)
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
    types = schema_types(schema)
    result = value if types is None else _coerce_kind(value, types, schema, root, path)
    if "enum" in schema and isinstance(schema["enum"], list) and result not in schema["enum"]:
        raise _CoerceError(f"{path}: {result!r} is not one of {schema['enum']}")
    if "const" in schema and result != schema["const"]:
        raise _CoerceError(f"{path}: must be {schema['const']!r}")
    return result


def _matches_exactly(value: Any, schema: Any, root: Mapping[str, Any]) -> bool:
    schema = resolve_refs(schema, root)
    if not isinstance(schema, Mapping):
        return True
    types = schema_types(schema)
    if types is None:
        return True
    kind = json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _coerce_kind(value: Any, types: set[str], schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> Any:
    kind = json_type(value)
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
        if parsed is not None and json_type(parsed) in types:
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
