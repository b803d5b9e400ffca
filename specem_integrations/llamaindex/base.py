"""``SpecEMLLM``: the SpecEM ensemble as a LlamaIndex function-calling LLM."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from specem_core.deadline import awithin, timeout_of, within
from specem_core.errors import ConfigError, InputError
from specem_core.presets import Preset, check_model_name, config_of, resolve
from specem_core.types import validate_messages
from specem_core.vocabulary import with_field_names
from specem_integrations._options import EnsembleFields, surface_arguments
from specem_integrations.llamaindex._convert import (
    new_tool_call_id,
    resolve_tool_choice,
    to_engine_messages,
    to_openai_tools,
    tool_kwargs_dict,
)

if TYPE_CHECKING:
    from llama_index.core.tools import BaseTool

    from specem_core.engine import SpecEM
    from specem_core.types import GenerationResult, StreamEvent

_IGNORED_KWARGS = frozenset({"formatted", "verbose"})
"""Keyword arguments LlamaIndex passes along that mean nothing to a local ensemble."""


def _check_members(value: Any) -> None:
    """``members`` is a list of specs or Member objects."""
    if isinstance(value, str) or not isinstance(value, list):
        raise ConfigError("SpecEMLLM: members must be a list of model names, paths, HF ids or Member objects")
    for i, m in enumerate(value):
        if isinstance(m, str):
            if not m.strip():
                raise ConfigError(f"SpecEMLLM: member {i} is an empty string")
        elif not isinstance(m, os.PathLike) and not (hasattr(m, "open") and hasattr(m, "name")):
            raise ConfigError(
                f"SpecEMLLM: member {i} is a {type(m).__name__}: give a model name, a path, an HF id or a Member object"
            )


class SpecEMLLM(FunctionCallingLLM, EnsembleFields):
    """A SpecEM ensemble (several LLMs voting segment by segment) as a LlamaIndex LLM.

    Use it wherever LlamaIndex takes an LLM: ``Settings.llm``, query and chat engines,
    ``FunctionAgent`` (tool calls come back as ``ToolCallBlock`` s) and ``ReActAgent``.

    Example:
        >>> from llama_index.core import Settings
        >>> from specem_integrations.llamaindex import SpecEMLLM
        >>> Settings.llm = SpecEMLLM(max_tokens=64)   # the default preset, loaded on first use
        >>> llm = SpecEMLLM(preset="fast", max_tokens=64)  # or model="fast"
        >>> llm = SpecEMLLM(members=["smollm2", "qwen2.5-coder"], segment_len=8)
        >>> llm = SpecEMLLM(engine=my_engine)              # an engine you built yourself  # doctest: +SKIP

    The engine is built lazily (on the first request or ``metadata`` access) and only once, even
    when several threads ask at the same time. Streaming yields one ``ChatResponse`` per
    committed segment: ``message`` holds the text so far and ``delta`` the new piece; the last
    one also carries the tool calls and the SpecEM trace. Every response puts the full
    ``GenerationResult.to_dict()`` in ``raw`` and the trace (``GenerationResult.trace()``: usage,
    members_per_round, wins, exclusions, every round's candidates, scores and weights) with
    OpenAI-style token counts, finish_reason and model_name in ``additional_kwargs``.
    """

    model: str | None = Field(
        default=None,
        description=(
            "A preset by name (the same as preset), or, with engine=, the name that engine is reported under "
            "(model_name is accepted too). Default: 'specem:' + the member names. Any other value is an error."
        ),
    )
    context_window: int | None = Field(
        default=None,
        gt=0,
        description="Override of the context window (default: the smallest member's).",
    )
    # The ensemble (preset, members, backend, member_kwargs, api_key, member_weights,
    # engine_options, timeout) and every option a user tunes (max_tokens, temperature, stop, …,
    # max_retries: specem_core.config.USER_OPTIONS) are EnsembleFields, declared once for every
    # surface in specem_integrations/_options.py, with their docs.

    _engine: Any = PrivateAttr(default=None)
    _engine_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, engine: SpecEM | None = None, **kwargs: Any) -> None:
        """Create the LLM.

        Args:
            engine: a ready :class:`specem_core.SpecEM`; without one, the engine is built on
                first use from the preset and ``members``.
            **kwargs: the fields above and LlamaIndex's own (``callback_manager``,
                ``system_prompt``, ...).

        Raises:
            ConfigError: an unknown argument (with the closest names), an unknown preset, a
                ``model`` that names no preset, or an invalid setting.
        """
        kwargs = surface_arguments(
            with_field_names(kwargs, {"model_name": "model"}, where="SpecEMLLM"),
            where="SpecEMLLM",
            known=type(self).model_fields,
        )
        members = kwargs.get("members")
        if members is not None:
            _check_members(members)
        super().__init__(**kwargs)
        if engine is not None and not (callable(getattr(engine, "stream", None)) and hasattr(engine, "astream")):
            raise TypeError(f"engine must be a specem_core.SpecEM, got {type(engine).__name__}")
        if engine is not None and (self.preset is not None or self.members is not None):
            raise ConfigError("SpecEMLLM: engine= is a ready ensemble; it takes no preset= or members=")
        self._engine = engine
        if engine is None:  # with engine=, model is the name that engine is reported under
            check_model_name(self.model, self.preset, where="SpecEMLLM")
        self._config_overrides({})  # every setting checked now, not at the first request

    def _preset(self) -> Preset | None:
        """The preset this LLM runs (none with ``engine=``, or ``members=`` without a preset)."""
        if self._engine is not None and self.preset is None and self.members is None:
            return None
        return resolve(self.preset or self.model, members_given=self.members is not None)

    @classmethod
    def class_name(cls) -> str:
        """Serialization name."""
        return "SpecEM_LLM"

    # -- engine ---------------------------------------------------------------------------------
    @property
    def engine(self) -> SpecEM:
        """The engine, built on first access (thread-safe, once)."""
        engine = self._engine
        if engine is None:
            with self._engine_lock:
                if self._engine is None:
                    self._engine = self._build_engine()
                engine = self._engine
        return engine  # type: ignore[no-any-return]

    @property
    def engine_loaded(self) -> bool:
        """True once the engine exists (passed in or built)."""
        return self._engine is not None

    def _build_engine(self) -> SpecEM:
        return self.assemble_engine(self._preset())

    def _config_overrides(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """SpecEM config for one request: engine_options < the LLM's fields < call kwargs."""
        overrides = self.config_overrides(
            kwargs, where="SpecEMLLM", ignored=[*_IGNORED_KWARGS, "timeout"], extra=["tools", "tool_choice"]
        )
        # Fail here, with the option's name, rather than deep inside the engine.
        self._validate_config(overrides)
        return overrides

    def _validate_config(self, overrides: dict[str, Any]) -> None:
        engine = self._engine
        if engine is not None and hasattr(engine, "config"):
            engine.config.replace(**overrides)
        else:
            config_of(self._preset(), **overrides)

    def _timeout(self, kwargs: dict[str, Any]) -> float | None:
        """The request's timeout: the per-call one, else the instance's."""
        return timeout_of(kwargs.get("timeout"), self.timeout, where="SpecEMLLM")

    @property
    def metadata(self) -> LLMMetadata:
        """Context window of the smallest member, ``num_output`` = ``max_new_tokens``."""
        engine = self.engine
        window = self.context_window or getattr(engine, "context_window", None) or DEFAULT_CONTEXT_WINDOW
        config = getattr(engine, "config", None)
        num_output = self.max_tokens or (config.max_new_tokens if config is not None else 256)
        return LLMMetadata(
            context_window=int(window),
            num_output=int(num_output),
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self._resolved_model_name(engine),
        )

    def _resolved_model_name(self, engine: Any) -> str:
        if self.model:
            return self.model
        names = [getattr(m, "name", "?") for m in getattr(engine, "members", [])]
        return "specem:" + "+".join(names) if names else "specem"

    # -- requests -------------------------------------------------------------------------------
    def _request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Engine messages and engine keyword arguments; raises on bad input before any work."""
        engine_messages = validate_messages(to_engine_messages(messages))  # the engine's own check, early
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        tool_required = bool(kwargs.pop("tool_required", False))
        parallel = kwargs.pop("parallel_tool_calls", kwargs.pop("allow_parallel_tool_calls", False))
        response_format = kwargs.pop("response_format", None)
        call: dict[str, Any] = self._config_overrides(kwargs)
        if tools:
            schemas = to_openai_tools(tools)
            call["tools"] = schemas
            call["parallel_tool_calls"] = bool(parallel)
            choice = resolve_tool_choice(tool_choice, tool_required, [s["function"]["name"] for s in schemas])
            if choice is not None:
                call["tool_choice"] = choice
        elif tool_choice not in (None, "auto", "none") or tool_required:
            raise InputError("tool_choice / tool_required given without any tools")
        if response_format is not None:
            call["response_format"] = response_format
        return engine_messages, call

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Run the ensemble to the end of its answer."""
        engine_messages, call = self._request(messages, kwargs)
        timeout = self._timeout(kwargs)
        result: GenerationResult | None = None
        if timeout is None:
            result = self.engine.generate(engine_messages, **call)
        else:  # the answer streams so that the deadline is checked as each segment commits
            for event in within(self.engine.stream(engine_messages, **call), timeout, where="SpecEMLLM"):
                if event.done:
                    result = event.result
        if result is None:  # pragma: no cover - the engine always ends with a result
            raise RuntimeError("the SpecEM engine returned no result")
        return self._final_response(result, delta=None)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """One response per committed segment (cumulative ``message``, new ``delta``)."""
        engine_messages, call = self._request(messages, kwargs)
        timeout = self._timeout(kwargs)
        engine = self.engine
        events = engine.stream(engine_messages, **call)

        def gen() -> ChatResponseGen:
            stream = _Stream(self)
            # within() closes the run however it ends: a consumer that stops early frees the caches
            for event in within(events, timeout, where="SpecEMLLM"):
                response = stream.on_event(event)
                if response is not None:
                    yield response

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat` (the ensemble runs in a worker thread)."""
        engine_messages, call = self._request(messages, kwargs)
        timeout = self._timeout(kwargs)
        engine = await self._aengine()
        try:
            result = await asyncio.wait_for(engine.agenerate(engine_messages, **call), timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"SpecEMLLM did not finish within timeout={timeout}s") from exc
        return self._final_response(result, delta=None)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`."""
        engine_messages, call = self._request(messages, kwargs)
        timeout = self._timeout(kwargs)
        engine = await self._aengine()

        async def gen() -> ChatResponseAsyncGen:
            stream = _Stream(self)
            events: AsyncIterator[StreamEvent] = engine.astream(engine_messages, **call)
            async for event in awithin(events, timeout, where="SpecEMLLM"):
                response = stream.on_event(event)
                if response is not None:
                    yield response

        return gen()

    async def _aengine(self) -> SpecEM:
        if self._engine is not None:
            return self._engine  # type: ignore[no-any-return]
        return await asyncio.to_thread(lambda: self.engine)

    # -- completion views -----------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Completion through :meth:`chat` (the prompt becomes one user message)."""
        return chat_to_completion_decorator(self.chat)(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Streaming completion through :meth:`stream_chat`."""
        return stream_chat_to_completion_decorator(self.stream_chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Async :meth:`complete`."""
        return await achat_to_completion_decorator(self.achat)(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`."""
        return await astream_chat_to_completion_decorator(self.astream_chat)(prompt, **kwargs)

    # -- tools ----------------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Arguments of :meth:`chat` for a tool-calling turn (the caller's history is copied)."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        schemas = to_openai_tools(list(tools)) if tools else []
        # Resolve now so that a bad tool_choice fails before the ensemble runs.
        resolve_tool_choice(tool_choice, tool_required, [s["function"]["name"] for s in schemas])
        out: dict[str, Any] = {"messages": messages, **kwargs}
        if schemas:
            out["tools"] = schemas
            out["parallel_tool_calls"] = allow_parallel_tool_calls
            if tool_choice is not None:
                out["tool_choice"] = tool_choice
            if tool_required:
                out["tool_required"] = True
        return out

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Keep only the first tool call unless parallel calls are allowed (the response is copied)."""
        if allow_parallel_tool_calls:
            return response
        return force_single_tool_call(response)

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        """The ``ToolCallBlock`` s of a response as ``ToolSelection`` s."""
        blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not blocks:
            if error_on_no_tool_call:
                raise ValueError(
                    f"expected at least one tool call in the response, got none: {response.message.content!r}"
                )
            return []
        return [
            ToolSelection(
                tool_id=b.tool_call_id or new_tool_call_id(),
                tool_name=b.tool_name,
                tool_kwargs=tool_kwargs_dict(b.tool_kwargs),
            )
            for b in blocks
        ]

    # -- responses ------------------------------------------------------------------------------
    def _final_response(self, result: GenerationResult, delta: str | None) -> ChatResponse:
        """The response carrying the whole answer, the tool calls and the trace."""
        content = getattr(result, "content", None)
        text = result.text if content is None else content
        calls = list(getattr(result, "tool_calls", None) or [])
        blocks: list[Any] = [TextBlock(text=text)]
        for call in calls:
            blocks.append(
                ToolCallBlock(
                    tool_call_id=str(getattr(call, "id", None) or new_tool_call_id()),
                    tool_name=str(call.name),
                    tool_kwargs=dict(call.arguments) if isinstance(call.arguments, dict) else call.arguments,
                )
            )
        trace = trace_summary(result, self._resolved_model_name(self._engine))
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
            delta=delta,
            raw=result.to_dict(),
            additional_kwargs=trace,
        )


class _Stream:
    """Turns engine stream events into cumulative ``ChatResponse`` s."""

    def __init__(self, llm: SpecEMLLM) -> None:
        self.llm = llm
        self.text = ""

    def on_event(self, event: StreamEvent) -> ChatResponse | None:
        self.text += event.delta
        if event.done:
            if event.result is None:  # pragma: no cover - the engine always attaches the result
                raise RuntimeError("the SpecEM stream ended without a result")
            return self.llm._final_response(event.result, delta=event.delta)
        if not event.delta:
            return None
        extra: dict[str, Any] = {}
        if event.segment is not None:
            extra["segment"] = event.segment.to_dict()
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=self.text),
            delta=event.delta,
            additional_kwargs=extra,
        )


def trace_summary(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """What goes in ``ChatResponse.additional_kwargs``: token counts under OpenAI's key names (as
    LlamaIndex's OpenAI LLM reports them; in the first member's tokens), ``finish_reason``,
    ``model_name`` and the SpecEM trace (:meth:`GenerationResult.trace`: ``usage["per_member"]``
    has every member's own counts)."""
    trace = result.trace()
    usage = trace["usage"]
    summary: dict[str, Any] = {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "finish_reason": result.finish_reason,
        "model_name": model_name,
        **trace,
    }
    if result.invalid_tool_calls:
        summary["invalid_tool_calls"] = [_plain(c) for c in result.invalid_tool_calls]
    return summary


def _plain(obj: object) -> Any:
    to_dict = getattr(obj, "to_dict", None)
    return to_dict() if callable(to_dict) else repr(obj)


def force_single_tool_call(response: ChatResponse) -> ChatResponse:
    """A copy of ``response`` that keeps only its first ``ToolCallBlock``."""
    blocks = list(response.message.blocks)
    calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
    if len(calls) <= 1:
        return response
    keep = calls[0]
    message = response.message.model_copy(
        update={"blocks": [b for b in blocks if not isinstance(b, ToolCallBlock) or b is keep]}
    )
    return response.model_copy(update={"message": message})
