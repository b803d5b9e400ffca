"""The OpenAI chat-completions wire format: request validation, conversion, response bodies.

Requests are validated with pydantic v2 in strict mode (a string where a number belongs is a
400 naming the parameter, not a silent coercion); unknown top-level fields are ignored as
OpenAI-compatible servers usually do, and features SpecEM cannot honour (``n > 1``,
``logprobs``, penalties, ``logit_bias``, non-text content) are refused with a 400.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from specem_core.config import (
    MAX_TEMPERATURE,
    OPTIONS,
    REMOVED,
    RENAMED,
    SpecEMConfig,
    current_names,
)
from specem_core.errors import ConfigError, InputError
from specem_core.tools import OutputPlan, normalize_tool_choice, normalize_tools
from specem_core.types import GenerationResult, ToolCall, validate_messages
from specem_core.vocabulary import ALIASES, OPENAI_ALIASES
from specem_integrations._options import request_field_definitions
from specem_integrations.server._errors import APIError, invalid_request

_log = logging.getLogger("specem.server")

TRACE_HEADER = "x-specem-trace"
"""Request header that asks for the per-round trace (``1``/``true``), like ``{"specem": {"trace": true}}``."""

_TEXT_PARTS = ("text", "input_text", "output_text")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionCallIn(_Strict):
    """``function`` of an assistant tool call (``arguments`` is a JSON string, or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Strict):
    """An assistant message's tool call."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class MessageIn(_Strict):
    """One chat message as OpenAI clients send it."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Strict):
    """``stream_options``."""

    include_usage: bool | None = None


class _SpecEMOptionsBase(BaseModel):
    """The ``specem`` extension object of a request: the trace, a preset's settings, and every
    :class:`SpecEMConfig` option a request may set (:data:`REQUEST_FIELDS`, typed as the config
    types them: derived, never retyped). The OpenAI fields (``max_tokens``, ``temperature``,
    ``top_p``, ``seed``, ``stop``) go at the top level. Unset fields keep the server's (its
    preset's) values. Option names of 0.1 are accepted with a warning until 0.3."""

    model_config = ConfigDict(strict=True, extra="forbid")

    trace: bool = False
    """Return the per-round trace (candidates, scores, weights, winners)."""
    preset: str | None = None
    """A preset's settings for this request (``specem presets``): allowed when the preset's members
    are the server's members; its fields apply first and the other fields here override them. The
    member weights stay the server's (start the server with ``--preset`` for the preset's prior)."""

    @model_validator(mode="before")
    @classmethod
    def _current_names(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and any(key in RENAMED or key in REMOVED for key in data):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    data = current_names(data, where="the 'specem' request object")
                except ConfigError as exc:
                    raise ValueError(str(exc)) from None
            for warning in caught:
                _log.warning("%s", warning.message)
        return data


_TOP_LEVEL = frozenset({"max_new_tokens", "temperature", "top_p", "seed", "stop"})
"""Options a request sets with OpenAI's top-level fields, not in the ``specem`` object."""
REQUEST_FIELDS = tuple(name for name in OPTIONS if name not in _TOP_LEVEL and name != "parallel")
"""The SpecEMConfig fields a request's ``specem`` object may set: every option but the OpenAI
top-level ones and ``parallel`` (how the server runs its members is the server's)."""

if TYPE_CHECKING:  # the fields below are read by name (REQUEST_FIELDS), never as attributes
    SpecEMOptions = _SpecEMOptionsBase
else:
    SpecEMOptions = create_model(
        "SpecEMOptions",
        __base__=_SpecEMOptionsBase,
        __module__=__name__,
        __doc__=_SpecEMOptionsBase.__doc__,
        **request_field_definitions(REQUEST_FIELDS),
    )


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions`` body."""

    model: str | None = None
    messages: list[MessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_sequences: str | list[str] | None = None
    """The other spelling of ``stop`` (:data:`specem_core.vocabulary.ALIASES`); not both."""
    max_retries: int | None = None
    """Retries of a failing member call (``SpecEMConfig.member_retries``; also ``specem.member_retries``)."""
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    specem: SpecEMOptions | None = None


@dataclass
class EngineCall:
    """What one request asks of the engine, validated."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    """``tools``, ``tool_choice``, ``response_format``, ``parallel_tool_calls``."""
    overrides: dict[str, Any]
    """Per-request :class:`SpecEMConfig` overrides."""
    stream: bool
    include_usage: bool
    trace: bool
    model: str | None
    has_tools: bool = False
    params: dict[str, str] = field(default_factory=dict)
    """Override name → request parameter (for error messages)."""


# -- validation --------------------------------------------------------------------------------
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "literal", "model", "is-instance"})


def _param(loc: Sequence[int | str]) -> str | None:
    """``("messages", 0, "content", "str")`` → ``messages[0].content`` (pydantic's union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper():
            break
        out += f".{part}" if out else part
    return out or None


def parse_request(body: object) -> ChatCompletionRequest:
    """Validate a decoded JSON body.

    Raises:
        APIError: 400 naming the first wrong parameter.
    """
    if not isinstance(body, dict):
        raise invalid_request(
            f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json"
        )
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        param = _param(errors[0]["loc"])
        same = [e for e in errors if _param(e["loc"]) == param]
        if same[0]["type"] == "missing":
            raise invalid_request(
                f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
            ) from None
        if same[0]["type"] == "extra_forbidden":
            raise invalid_request(f"Unrecognized parameter: '{param}'.", param, "unknown_parameter") from None
        reasons = "; or ".join(dict.fromkeys(str(e["msg"]) for e in same))
        raise invalid_request(f"Invalid value for '{param}': {reasons}.", param, "invalid_type") from None


def _text_content(content: str | list[Any] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(part, str):
            parts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise invalid_request(f"content parts must be objects, got {type(part).__name__}", where, "invalid_type")
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "refusal":
            continue
        else:
            raise invalid_request(
                f"content part of type {kind!r} is not supported: SpecEM members read text only",
                f"{where}.type",
                "unsupported_content",
            )
    return "".join(parts)


def _arguments(arguments: str | dict[str, Any]) -> Any:
    """Tool-call arguments as an object (chat templates render objects), else the raw text."""
    if isinstance(arguments, dict):
        return dict(arguments)
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def engine_messages(messages: Sequence[MessageIn]) -> list[dict[str, Any]]:
    """OpenAI messages as the engine's chat dicts.

    Assistant ``tool_calls`` keep their ids and get their ``arguments`` as objects; ``tool``
    messages get the name of the call they answer; legacy ``function`` messages become ``tool``.

    Raises:
        APIError: 400 for non-text content or a conversation the engine refuses.
    """
    call_names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        text = _text_content(m.content, i)
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if m.tool_calls:
                calls = []
                for call in m.tool_calls:
                    entry: dict[str, Any] = {
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                    }
                    if call.id is not None:
                        entry["id"] = call.id
                        call_names[call.id] = call.function.name
                    calls.append(entry)
                msg["tool_calls"] = calls
            out.append(msg)
        elif m.role in ("tool", "function"):
            tool: dict[str, Any] = {"role": "tool", "content": text}
            if m.tool_call_id is not None:
                tool["tool_call_id"] = m.tool_call_id
            name = m.name or (call_names.get(m.tool_call_id) if m.tool_call_id is not None else None)
            if name:
                tool["name"] = name
            out.append(tool)
        else:
            msg = {"role": m.role, "content": text}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
    try:
        return validate_messages(out)
    except InputError as exc:
        raise invalid_request(str(exc), "messages", "invalid_value") from None


def _preset_settings(name: str, members: Sequence[str]) -> dict[str, Any]:
    """The request fields a per-request preset sets, or a 400 saying why it cannot apply here."""
    from specem_core.presets import get_preset

    try:
        preset = get_preset(name)
    except ConfigError as exc:
        raise invalid_request(str(exc), "specem.preset", "invalid_value") from None
    if sorted(preset.members) != sorted(members):
        raise invalid_request(
            f"preset {name!r} runs members {', '.join(preset.members)}; this server runs "
            f"{', '.join(members) or 'other members'} (start a server with --preset {name} for it).",
            "specem.preset",
            "invalid_value",
        )
    return {key: value for key, value in preset.config.items() if key in REQUEST_FIELDS}


def _unsupported(message: str, param: str) -> APIError:
    return invalid_request(message, param, "unsupported_parameter")


def build_call(
    req: ChatCompletionRequest,
    config: SpecEMConfig,
    *,
    trace_header: bool = False,
    members: Sequence[str] = (),
) -> EngineCall:
    """Check a parsed request against what SpecEM supports and turn it into an engine call
    (``members``: the server's member names, which a per-request ``specem.preset`` must match).

    Raises:
        APIError: 400 naming the parameter.
    """
    if req.n is not None and req.n != 1:
        raise _unsupported(f"n={req.n} is not supported: SpecEM returns exactly one choice (n=1).", "n")
    if req.logprobs:
        raise _unsupported("logprobs are not supported: the answer is voted segment by segment.", "logprobs")
    if req.top_logprobs:
        raise _unsupported("top_logprobs is not supported.", "top_logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        if value is not None and value != 0:
            raise _unsupported(
                f"{name} is not supported (use specem.repetition_penalty for an HF-style penalty).", name
            )
    if req.logit_bias:
        raise _unsupported("logit_bias is not supported.", "logit_bias")
    if not req.messages:
        raise invalid_request("messages is empty: give at least one message.", "messages", "invalid_value")

    overrides: dict[str, Any] = {}
    params: dict[str, str] = {}

    def put(key: str, value: Any, param: str) -> None:
        if value is not None:
            overrides[key] = value
            params[key] = param

    cap = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"  # OpenAI's newer name wins
    answer_cap = {**ALIASES, **OPENAI_ALIASES}[cap]
    put(answer_cap, getattr(req, cap), cap)
    if answer_cap in overrides and overrides[answer_cap] < 1:
        raise invalid_request(f"{cap} must be at least 1, got {overrides[answer_cap]}.", cap, "invalid_value")
    if req.temperature is not None and not (
        0.0 <= req.temperature <= MAX_TEMPERATURE and math.isfinite(req.temperature)
    ):
        raise invalid_request(
            f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {req.temperature}.",
            "temperature",
            "invalid_value",
        )
    if req.top_p is not None and not (0.0 < req.top_p <= 1.0):
        raise invalid_request(f"top_p must be in (0, 1], got {req.top_p}.", "top_p", "invalid_value")
    put("temperature", req.temperature, "temperature")
    put("top_p", req.top_p, "top_p")
    if req.seed is not None and not -(2**62) < req.seed < 2**62:
        raise invalid_request(f"seed must be between -2**62 and 2**62, got {req.seed}.", "seed", "invalid_value")
    put("seed", req.seed, "seed")
    if req.stop is not None and req.stop_sequences is not None:
        raise invalid_request("give stop or stop_sequences, not both.", "stop_sequences", "invalid_value")
    stop_param = "stop" if req.stop is not None else "stop_sequences"
    stop = req.stop if req.stop is not None else req.stop_sequences
    if stop is not None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in stops):
            raise invalid_request("stop strings must be non-empty.", stop_param, "invalid_value")
        if stops:
            put("stop", (*config.stop, *stops), stop_param)
    put("member_retries", req.max_retries, "max_retries")
    options = req.specem or SpecEMOptions()
    if options.preset is not None:
        for key, value in _preset_settings(options.preset, members).items():
            put(key, value, "specem.preset")
    for name in REQUEST_FIELDS:
        put(name, getattr(options, name), f"specem.{name}")
    for key, value in overrides.items():  # each override alone, so that the error names its parameter
        try:
            config.replace(**{key: value})
        except ConfigError as exc:
            raise invalid_request(str(exc), params[key], "invalid_value") from None

    tools = req.tools or None
    kwargs: dict[str, Any] = {}
    if tools is not None:
        try:
            normalized = normalize_tools(tools)
        except InputError as exc:
            raise invalid_request(str(exc), "tools", "invalid_tools") from None
        kwargs["tools"] = normalized
    else:
        normalized = []
    if req.tool_choice is not None:
        if not normalized and req.tool_choice not in ("none", "auto"):
            raise invalid_request("tool_choice is only allowed when tools are given.", "tool_choice", "invalid_tools")
        try:
            normalize_tool_choice(req.tool_choice, normalized)
        except InputError as exc:
            raise invalid_request(str(exc), "tool_choice", "invalid_tools") from None
        if normalized:
            kwargs["tool_choice"] = req.tool_choice
    if req.parallel_tool_calls and normalized:
        kwargs["parallel_tool_calls"] = True
    response_format = req.response_format
    if response_format is not None and response_format.get("type") != "text":
        kwargs["response_format"] = response_format
    try:
        OutputPlan.build(
            kwargs.get("tools"),
            kwargs.get("tool_choice"),
            kwargs.get("response_format"),
            parallel_tool_calls=bool(kwargs.get("parallel_tool_calls")),
        )
    except InputError as exc:
        # tools with a response format, or a bad tool setting: invalid_tools; a bad format alone: invalid_value
        code = "invalid_tools" if "tools" in kwargs else "invalid_value"
        raise invalid_request(str(exc), "response_format" if "response_format" in kwargs else "tools", code) from None

    stream = bool(req.stream)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return EngineCall(
        messages=engine_messages(req.messages),
        kwargs=kwargs,
        overrides=overrides,
        stream=stream,
        include_usage=include_usage,
        trace=options.trace or trace_header,
        model=req.model,
        has_tools=bool(normalized) and kwargs.get("tool_choice") != "none",
        params=params,
    )


# -- responses ---------------------------------------------------------------------------------
def usage_body(result: GenerationResult) -> dict[str, Any]:
    """OpenAI ``usage`` (in the first member's tokens, as SpecEM counts them), with
    ``prompt_tokens_details.cached_tokens``: prompt tokens read from the members' prefix caches,
    summed over members (per member in the trace's ``usage``)."""
    return {
        "prompt_tokens": result.usage.prompt_tokens,
        "completion_tokens": result.usage.completion_tokens,
        "total_tokens": result.usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": result.usage.cached_tokens},
    }


def tool_calls_body(result: GenerationResult) -> list[dict[str, Any]]:
    """Parsed calls in OpenAI's shape; calls that did not parse but have a name keep their raw arguments."""
    calls: list[dict[str, Any]] = [_call(c) for c in result.tool_calls]
    for bad in result.invalid_tool_calls:
        if bad.name:
            calls.append(
                {"id": bad.id, "type": "function", "function": {"name": bad.name, "arguments": bad.arguments or ""}}
            )
    return calls


def _call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }


def completion_body(
    result: GenerationResult, *, request_id: str, created: int, model: str, trace: bool
) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object."""
    calls = tool_calls_body(result)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": (result.content or None) if calls else (result.content or ""),
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage_body(result),
    }
    if trace:
        body["specem"] = result.trace()
    return body


@dataclass
class ChunkWriter:
    """Builds the ``chat.completion.chunk`` objects of one streamed answer."""

    request_id: str
    created: int
    model: str
    include_usage: bool

    def chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One chunk with one choice."""
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            body["usage"] = None
        if extra:
            body.update(extra)
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [],
            "usage": usage_body(result),
        }

    def tool_call_chunks(self, result: GenerationResult) -> list[dict[str, Any]]:
        """Each call as OpenAI streams it: id, type and name first, then the arguments."""
        out: list[dict[str, Any]] = []
        for index, call in enumerate(tool_calls_body(result)):
            fn = call["function"]
            head = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            out.append(self.chunk({"tool_calls": [head]}))
            out.append(self.chunk({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}))
        return out


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def error_event(error: APIError) -> bytes:
    """An error inside a stream that has already started (OpenAI sends ``data: {"error": …}``)."""
    return sse(error.body())
