"""``SpecEM``, the public face of the ensemble: members and configuration in, answers out, as
``generate``, ``stream``, ``agenerate`` and ``astream``.

The loop itself is :mod:`specem_core.loop` (one request, round by round as in the paper); this
module validates a request, plans its output (tools, JSON: :mod:`specem_core.tools`) and hands
the loop's events to the caller, through a worker thread for the async views
(:mod:`specem_core.threads`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specem_core.backends.base import Member, SettlingMember
from specem_core.config import SpecEMConfig, renamed_argument
from specem_core.errors import ConfigError
from specem_core.loop import CandidateFilter, Run
from specem_core.observers import MemberObserver, Observers
from specem_core.presets import DEFAULT_PRESET, EnsemblePlan, Preset
from specem_core.presets import plan as plan_ensemble
from specem_core.threads import Workers
from specem_core.tools import MAX_TOOL_ROUNDS, OutputPlan, tool_rounds
from specem_core.trusted import check_trusted_member, choose_trusted
from specem_core.types import GenerationResult, StreamEvent, Trusted, check_unicode, validate_messages
from specem_core.weights import MemberWeights

__all__ = ["CandidateFilter", "Request", "SpecEM", "default_engine"]

logger = logging.getLogger("specem")


@dataclass(frozen=True)
class Request:
    """One request as :meth:`SpecEM.generate`, :meth:`~SpecEM.stream`, :meth:`~SpecEM.agenerate`
    and :meth:`~SpecEM.astream` take it: the arguments travel together, by name, from the public
    methods to the run (the same fields, the same meanings, as those methods document)."""

    messages: Sequence[Mapping[str, Any]] | str
    """The conversation (or one user message as a string)."""
    tools: Sequence[Mapping[str, Any]] | None = None
    """OpenAI-style tool schemas."""
    tool_choice: Any = None
    """``"auto"`` (default), ``"none"``, ``"any"``/``"required"`` or a tool name."""
    response_format: Mapping[str, Any] | None = None
    """``{"type": "json_object"}`` or a JSON schema: the answer is one JSON object."""
    parallel_tool_calls: bool = False
    """Several calls in one answer."""
    constraint: CandidateFilter | None = None
    """An optional filter on candidates."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """:class:`SpecEMConfig` fields for this request only."""


class SpecEM:
    """A segment-level ensemble of language models (SpecEM, NeurIPS 2025).

    Each round every drafting member proposes the next ``segment_len`` tokens, every verifying
    member scores every proposal, the weighted vote picks one, and all members continue from it.

    Example:
        >>> from specem_core import SpecEM, SpecEMConfig, load_member   # doctest: +SKIP
        >>> engine = SpecEM([load_member("smollm2"), load_member("qwen2.5-coder")],
        ...                 SpecEMConfig(max_new_tokens=64))               # doctest: +SKIP
        >>> result = engine.generate([{"role": "user", "content": "Capital of France?"}])  # doctest: +SKIP
        >>> for event in engine.stream("Name three colours."):            # doctest: +SKIP
        ...     print(event.delta, end="")

    The engine is safe to share between threads: members hold only read-only weights and every
    request gets its own sessions.

    Member weights (verifier weights learned across requests) are opt-in: pass ``member_weights=MemberWeights(...)``, or
    the path of a JSON state file (loaded when it exists, created otherwise, saved after every
    request), and every request starts from what earlier requests taught it, then adds its own
    Hedge rewards (:mod:`specem_core.weights`). ``reproduce_paper=True`` requests
    keep the paper's per-request rule and neither read nor update it.
    """

    def __init__(
        self,
        members: Sequence[Member],
        config: SpecEMConfig | None = None,
        *,
        member_weights: MemberWeights | str | os.PathLike[str] | None = None,
        weights: MemberWeights | str | os.PathLike[str] | None = None,
        observers: Iterable[MemberObserver] = (),
        **config_overrides: Any,
    ) -> None:
        members = list(members)
        if not members:
            raise ConfigError("an ensemble needs at least one member")
        names = [m.name for m in members]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"member names must be unique; repeated: {', '.join(duplicates)}")
        if not any(m.can_draft for m in members):
            raise ConfigError("no member can draft: at least one member needs can_draft=True")
        if sum(m.can_draft for m in members) > 1 and not any(m.can_verify for m in members):
            raise ConfigError("several drafters but no verifier: set can_verify=True on a member")
        self._workers = Workers()
        """The threads running :meth:`astream` requests (for :meth:`wait_idle`)."""
        self._observers = Observers(observers)
        """Told of every member session and call (:meth:`add_observer`)."""
        self._members = members
        self._config = (config or SpecEMConfig()).replace(**config_overrides)
        weights = renamed_argument(member_weights, weights, where="SpecEM", new="member_weights", old="weights")
        if weights is not None and not isinstance(weights, MemberWeights):
            weights = MemberWeights.open(weights)
        if weights is not None and weights.prior:
            # a misspelt name: a prior entry for no member while a member has none, which would
            # silently fall back to the mean prior (a state shared with a larger ensemble, whose
            # extra entries name members absent here, is fine)
            unknown = sorted(set(weights.prior) - set(names))
            unpriored = [n for n in names if n not in weights.prior]
            if unknown and unpriored:
                raise ConfigError(
                    f"the member-weights prior names {', '.join(unknown)}, not in this ensemble, and has no entry "
                    f"for {', '.join(unpriored)}: a misspelt member name? The members are {', '.join(names)}"
                )
        self._weights = weights
        trusted = self.trusted()  # checks trusted_member
        logger.info("trusted member: %s (%s)", trusted.member or "none", trusted.reason)

    @classmethod
    def from_preset(cls, name: str | Preset | None = None, **overrides: Any) -> SpecEM:
        """The engine of a named preset (:mod:`specem_core.presets`; ``None``: the default, the
        one ``specem presets`` marks), with explicit arguments overriding the preset's.

        Args:
            name: ``"quality"``, ``"fast"``, ``"paper"``, … (``specem presets`` lists them).
            **overrides: :class:`SpecEMConfig` fields over the preset's; ``members`` (specs or
                members: replaces the preset's, and drops its prior unless ``member_weights`` is given);
                ``verifiers`` (verify-only members); ``member_weights`` (a ``MemberWeights``, a
                state-file path, or ``False`` for none) and ``min_share``; ``config`` (a whole
                :class:`SpecEMConfig` instead of the preset's settings); ``backend``, ``device``,
                ``member_kwargs`` and ``api_key`` for loading members by name. The assembly is
                :func:`specem_core.presets.plan`, which every surface goes through.

        Example:
            >>> engine = SpecEM.from_preset("quality", max_new_tokens=128)  # doctest: +SKIP
            >>> engine.generate("Capital of France?").text  # doctest: +SKIP

        Raises:
            ConfigError: an unknown preset (the message lists them) or an unknown/invalid field.
        """
        return cls.from_plan(plan_ensemble(name, **overrides))

    @classmethod
    def from_plan(cls, ensemble: EnsemblePlan) -> SpecEM:
        """The engine of an :class:`~specem_core.presets.EnsemblePlan` (:func:`specem_core.presets.plan`,
        checked and not yet loaded): its members loaded, its configuration and member weights."""
        parts = ensemble.load()
        return cls(parts.members, parts.config, member_weights=parts.member_weights)

    def add_observer(self, observer: MemberObserver) -> Callable[[], None]:
        """Tell ``observer`` about every member session opened and closed and every member call
        of the requests that start from now on (:mod:`specem_core.observers`); returns a function
        that removes it. An observer that raises is logged and skipped, never failing a request."""
        return self._observers.add(observer)

    @property
    def active_workers(self) -> int:
        """Worker threads of async requests (:meth:`astream`, :meth:`agenerate`) running now; a
        cancelled request's ends after its current round."""
        return self._workers.running()

    @property
    def member_weights(self) -> MemberWeights | None:
        """The member weights shared across requests, which start each request's verifier
        weights (``None``: the paper's per-request rule)."""
        return self._weights

    @property
    def weights(self) -> MemberWeights | None:
        """Deprecated (until 0.3): :attr:`member_weights`."""
        warnings.warn(
            "SpecEM.weights is now SpecEM.member_weights; the old name stops working in 0.3",
            FutureWarning,
            stacklevel=2,
        )
        return self._weights

    def trusted(self, **overrides: Any) -> Trusted:
        """The member a request (with these :class:`SpecEMConfig` overrides) starts by trusting,
        and why: ``trusted_member`` if set, else the drafter with the highest prior in the member
        weights, else none (the rule: :func:`specem_core.trusted.choose_trusted`). A request
        reports its own in ``result.trusted`` (a member excluded before the first round is not
        trusted). Surfaces say it at start-up.

        Raises:
            ConfigError: ``trusted_member`` names no member that drafts.
        """
        config = self._config.replace(**overrides)
        check_trusted_member(self._members, config.trusted_member)
        drafters = {i: 1.0 for i, m in enumerate(self._members) if m.can_draft}
        index, reason = choose_trusted(self._members, drafters, self._weights, config.trusted_member)
        return Trusted(self._members[index].name if index is not None else None, reason)

    @property
    def members(self) -> list[Member]:
        """The members, in tie-break order."""
        return list(self._members)

    @property
    def config(self) -> SpecEMConfig:
        """Default configuration of every request."""
        return self._config

    @property
    def context_window(self) -> int | None:
        """The smallest known context window among the members."""
        windows = [m.context_window for m in self._members if m.context_window]
        return min(windows) if windows else None

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = False,
        constraint: CandidateFilter | None = None,
        **overrides: Any,
    ) -> GenerationResult:
        """Run the ensemble to completion.

        Args:
            messages: the conversation (or one user message as a string).
            tools: OpenAI-style tool schemas rendered through each member's chat template.
                Tool calls are then parsed into ``result.tool_calls`` and kept parseable by a
                candidate constraint (see :mod:`specem_core.tools`).
            tool_choice: ``"auto"`` (default), ``"none"``, ``"any"``/``"required"`` or a tool name;
                forcing commits the start of a call before the first round.
            response_format: ``{"type": "json_object"}`` or ``{"type": "json_schema",
                "json_schema": {"schema": {...}}}``: the answer is one JSON object.
            parallel_tool_calls: allow several calls in one answer (default: the answer ends
                after the first call).
            constraint: optional filter on candidates (see :class:`CandidateFilter`).
            **overrides: any :class:`SpecEMConfig` field for this request only.
        """
        result: GenerationResult | None = None
        for event in self.stream(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            parallel_tool_calls=parallel_tool_calls,
            constraint=constraint,
            **overrides,
        ):
            result = event.result if event.done else result
        assert result is not None
        return result

    def stream(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = False,
        constraint: CandidateFilter | None = None,
        **overrides: Any,
    ) -> Iterator[StreamEvent]:
        """Yield one :class:`StreamEvent` per committed segment as soon as it is committed."""
        request = Request(messages, tools, tool_choice, response_format, parallel_tool_calls, constraint, overrides)
        _run, events = self._events(request)
        return events

    def _events(self, request: Request) -> tuple[Run, Iterator[StreamEvent]]:
        """A request's run and its events; with tools or JSON output, the events of the output
        plan, which may replace an answer an agent loop cannot use by another run."""
        run, plan = self._prepare(request)
        if plan is None:
            return run, run.events()

        def answer_instead() -> Iterator[StreamEvent]:  # the answer was a repeat, a loop or junk
            return self._instead(request, "none")

        def call_instead() -> Iterator[StreamEvent]:  # the answer was a call the parser cannot read
            return self._instead(request, "required")

        return run, plan.wrap(run.events(), run.messages, answer_instead, call_instead)

    def _instead(self, request: Request, tool_choice: str) -> Iterator[StreamEvent]:
        """The run that replaces an answer an agent loop cannot use: ``"none"``, words without
        tools (from the tool results when there are some; never a call:
        :class:`~specem_core.tools.AnswerConstraint`), or ``"required"``, a call written under
        :class:`~specem_core.tools.ToolCallConstraint`, so that it parses."""
        instead = dataclasses.replace(request, tool_choice=tool_choice, response_format=None, parallel_tool_calls=False)
        run, plan = self._prepare(instead, answering=tool_choice == "none")
        assert plan is not None
        return plan.wrap(run.events(), run.messages)

    def _prepare(self, request: Request, *, answering: bool = False) -> tuple[Run, OutputPlan | None]:
        """Validate a request and set up its run (tools and JSON output via :class:`OutputPlan`)."""
        config = self._config.replace(**request.overrides)
        msgs = validate_messages(request.messages)
        tools = request.tools
        check_unicode(tools, "tools")  # rendered into every member's prompt
        check_unicode(request.response_format, "response_format")
        plan = OutputPlan.build(
            tools,
            request.tool_choice,
            request.response_format,
            parallel_tool_calls=request.parallel_tool_calls,
            answering=answering,
        )
        if plan is not None and plan.choice.mode == "auto" and plan.tools and tool_rounds(msgs) >= MAX_TOOL_ROUNDS:
            plan = OutputPlan.build(tools, "none", answering=True)  # the agent loop ran long enough: answer
        learned = None if config.reproduce_paper else self._weights
        if plan is None:
            run = Run(
                self._members, config, msgs, tools, request.constraint, learned=learned, observers=self._observers
            )
            return run, None
        if plan.stop:
            config = config.replace(stop=(*config.stop, *plan.stop))
        run = Run(
            self._members,
            config,
            plan.prepare_messages(msgs),
            plan.tools or None,
            plan.combine(request.constraint),
            prefill=plan.prefill,
            prefill_choices=plan.choices,
            learned=learned,
            observers=self._observers,
        )
        return run, plan

    async def agenerate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = False,
        constraint: CandidateFilter | None = None,
        **overrides: Any,
    ) -> GenerationResult:
        """Async :meth:`generate`."""
        result: GenerationResult | None = None
        async for event in self.astream(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            response_format=response_format,
            parallel_tool_calls=parallel_tool_calls,
            constraint=constraint,
            **overrides,
        ):
            result = event.result if event.done else result
        assert result is not None
        return result

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout`` seconds) until no request runs in a background thread and the
        members' background work is done (llama.cpp: prefix-cache copies). A process that exits
        while such a thread is inside a native library call can crash in that library's exit
        handlers; ``specem serve`` calls this after its shutdown. Returns whether all of it ended.
        """
        deadline = time.monotonic() + timeout
        self._workers.join(deadline)
        for member in self._members:
            if isinstance(member, SettlingMember):
                member.settle(max(0.0, deadline - time.monotonic()))
        return self._workers.idle()

    async def astream(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        response_format: Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = False,
        constraint: CandidateFilter | None = None,
        **overrides: Any,
    ) -> AsyncIterator[StreamEvent]:
        """Async :meth:`stream`: the loop runs in a worker thread; cancelling stops it after the round."""
        request = Request(messages, tools, tool_choice, response_format, parallel_tool_calls, constraint, overrides)
        run, events = self._events(request)
        # closed here, not when the garbage collector finalizes it: a consumer that stops early
        # must cancel the run now, not some rounds later
        async with contextlib.aclosing(self._workers.iterate(events, run.cancelled)) as stream:
            async for event in stream:
                yield event


def default_engine(*, backend: str | None = None, **config: Any) -> SpecEM:
    """The default preset's engine on ``backend`` (default: auto); the other keyword arguments are
    config fields over the preset's."""
    return SpecEM.from_preset(DEFAULT_PRESET, backend=backend, **config)
