"""JSON-schema helpers shared by the tools modules: local ``$ref`` s, the JSON types a schema
allows, ``anyOf`` / ``oneOf`` variants (argument coercion, tool-call and JSON-schema constraints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def resolve_refs(schema: Any, root: Mapping[str, Any]) -> Any:
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


def schema_types(schema: Mapping[str, Any]) -> set[str] | None:
    """The JSON types a schema allows (``None`` = anything)."""
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {str(x) for x in t}
    if "enum" in schema and isinstance(schema["enum"], list):
        return {json_type(v) for v in schema["enum"]}
    if "const" in schema:
        return {json_type(schema["const"])}
    if "properties" in schema:
        return {"object"}
    if "items" in schema:
        return {"array"}
    return None


def json_type(value: Any) -> str:
    """The JSON type name of a Python value (``bool`` is ``boolean``, not ``integer``)."""
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


def schema_variants(schema: Mapping[str, Any]) -> list[Any] | None:
    """The alternatives of an ``anyOf`` / ``oneOf`` schema (``None``: neither)."""
    for key in ("anyOf", "oneOf"):
        v = schema.get(key)
        if isinstance(v, list) and v:
            return v
    return None
