"""The SpecEM loop (SPEC §1): draft, verify, normalize, Hedge, vote, broadcast — per segment.

``SpecEM.stream`` is the loop; ``generate``, ``agenerate`` and ``astream`` are views of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from specem_core.backends.base import Member, MemberSession, SamplingParams, SessionRequest
from specem_core.candidates import constrain, to_line_end
from specem_core.config import SpecEMConfig
from specem_core.errors import AllMembersFailedError, ConfigError, InputError, MemberError
from specem_core.pool import MemberPool
from specem_core.presets import DEFAULT_PRESET, Preset, assemble
from specem_core.scoring import ModelExit, argmax_first, combine, normalize_row
from specem_core.stops import find_stop, stop_holdback
from specem_core.tools import (
    MAX_TOOL_ROUNDS,
    OutputPlan,
    call_in_progress,
    opens_call,
    opens_tool_listing,
    tool_rounds,
)
from specem_core.types import (
    Candidate,
    CandidateScore,
    Draft,
    Exclusion,
    FinishReason,
    GenerationResult,
    MemberUsage,
    Segment,
    StreamEvent,
    Usage,
    check_unicode,
    validate_messages,
)
from specem_core.vote import distinct, row_values, score_rows, tally
from specem_core.weights import MemberWeights

T = TypeVar("T")

CandidateFilter = Callable[[str, str], bool]
"""``constraint(committed_text, candidate_text) -> keep?`` — e.g. keep a started tool call
parseable. When it rejects every candidate of a round, all of them stay in the vote. Optional
methods the engine uses when present: ``trim(committed, candidate)`` (the longest acceptable
prefix), ``options(committed)`` (listable continuations, voted on when no candidate fits) and
``complete(text)`` (the answer is a whole document: it ends there with ``stop``)."""


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

    Verifier weights learned across requests are opt-in: pass ``weights=MemberWeights(...)``, or
    the path of a JSON state file (loaded when it exists, created otherwise, saved after every
    request), and every request starts from what earlier requests taught it, then adds its own
    Hedge rewards (:mod:`specem_core.weights`). ``faithful=True`` requests
    keep the paper's per-request rule and neither read nor update it.
    """

    def __init__(
        self,
        members: Sequence[Member],
        config: SpecEMConfig | None = None,
        *,
        weights: MemberWeights | str | os.PathLike[str] | None = None,
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
        self._workers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        """The threads running :meth:`astream` requests (for :meth:`wait_idle`)."""
        self._members = members
        self._config = (config or SpecEMConfig()).replace(**config_overrides)
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

    @classmethod
    def from_preset(cls, name: str | Preset | None = None, **overrides: Any) -> SpecEM:
        """The engine of a named preset (:mod:`specem_core.presets`; ``None``: the default, the
        one ``specem presets`` marks), with explicit arguments overriding the preset's.

        Args:
            name: ``"quality"``, ``"fast"``, ``"paper"``, … (``specem presets`` lists them).
            **overrides: :class:`SpecEMConfig` fields over the preset's; ``members`` (specs or
                members: replaces the preset's, and drops its prior unless ``weights`` is given);
                ``verifiers`` (verify-only members); ``weights`` (a ``MemberWeights``, a
                state-file path, or ``False`` for none) and ``min_share``; ``config`` (a whole
                :class:`SpecEMConfig` instead of the preset's settings); ``backend``, ``device``,
                ``member_kwargs`` and ``api_key`` for loading members by name. The assembly is
                :func:`specem_core.presets.assemble`, which every surface goes through.

        Example:
            >>> engine = SpecEM.from_preset("quality", max_new_tokens=128)  # doctest: +SKIP
            >>> engine.generate("Capital of France?").text  # doctest: +SKIP

        Raises:
            ConfigError: an unknown preset (the message lists them) or an unknown/invalid field.
        """
        parts = assemble(name, **overrides)
        return cls(parts.members, parts.config, weights=parts.weights)

    @property
    def weights(self) -> MemberWeights | None:
        """The verifier weights shared across requests (``None``: the paper's per-request rule)."""
        return self._weights

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
            constraint: optional filter on candidates (see :data:`CandidateFilter`).
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
        run, plan = self._prepare(
            messages, tools, tool_choice, response_format, parallel_tool_calls, constraint, overrides
        )
        if plan is None:
            return run.events()

        def answer_instead() -> Iterator[StreamEvent]:  # the answer was a repeat, a loop or junk
            return self._instead(messages, tools, constraint, overrides, "none")

        def call_instead() -> Iterator[StreamEvent]:  # the answer was a call the parser cannot read
            return self._instead(messages, tools, constraint, overrides, "required")

        return plan.wrap(run.events(), run.messages, answer_instead, call_instead)

    def _instead(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        tools: Sequence[Mapping[str, Any]] | None,
        constraint: CandidateFilter | None,
        overrides: dict[str, Any],
        tool_choice: str,
    ) -> Iterator[StreamEvent]:
        """The run that replaces an answer an agent loop cannot use: ``"none"``, words without
        tools (from the tool results when there are some; never a call:
        :class:`~specem_core.tools.AnswerConstraint`), or ``"required"``, a call written under
        :class:`~specem_core.tools.ToolCallConstraint`, so that it parses."""
        answering = tool_choice == "none"
        run, plan = self._prepare(messages, tools, tool_choice, None, False, constraint, overrides, answering=answering)
        assert plan is not None
        return plan.wrap(run.events(), run.messages)

    def _prepare(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: Any,
        response_format: Mapping[str, Any] | None,
        parallel_tool_calls: bool,
        constraint: CandidateFilter | None,
        overrides: dict[str, Any],
        *,
        answering: bool = False,
    ) -> tuple[_Run, OutputPlan | None]:
        """Validate a request and set up its run (tools and JSON output via :class:`OutputPlan`)."""
        config = self._config.replace(**overrides)
        msgs = validate_messages(messages)
        check_unicode(tools, "tools")  # rendered into every member's prompt
        check_unicode(response_format, "response_format")
        plan = OutputPlan.build(
            tools, tool_choice, response_format, parallel_tool_calls=parallel_tool_calls, answering=answering
        )
        if plan is not None and plan.choice.mode == "auto" and plan.tools and tool_rounds(msgs) >= MAX_TOOL_ROUNDS:
            plan = OutputPlan.build(tools, "none", answering=True)  # the agent loop ran long enough: answer
        learned = None if config.faithful else self._weights
        if plan is None:
            return _Run(self._members, config, msgs, tools, constraint, learned=learned), None
        if plan.stop:
            config = config.replace(stop=(*config.stop, *plan.stop))
        run = _Run(
            self._members,
            config,
            plan.prepare_messages(msgs),
            plan.tools or None,
            plan.combine(constraint),
            prefill=plan.prefill,
            prefill_choices=plan.choices,
            learned=learned,
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
        for worker in list(self._workers):
            worker.join(max(0.0, deadline - time.monotonic()))
        for member in self.members:
            settle = getattr(getattr(member, "model", None), "settle", None)
            if callable(settle):
                settle(max(0.0, deadline - time.monotonic()))
        return not any(w.is_alive() for w in list(self._workers))

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
        run, plan = self._prepare(
            messages, tools, tool_choice, response_format, parallel_tool_calls, constraint, overrides
        )
        events = run.events()
        if plan is not None:

            def answer_instead() -> Iterator[StreamEvent]:  # the answer was a repeat, a loop or junk
                return self._instead(messages, tools, constraint, overrides, "none")

            def call_instead() -> Iterator[StreamEvent]:  # the answer was a call the parser cannot read
                return self._instead(messages, tools, constraint, overrides, "required")

            events = plan.wrap(events, run.messages, answer_instead, call_instead)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def send(item: tuple[str, Any]) -> bool:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                run.cancelled.set()
                return False

        def pump() -> None:
            try:
                for event in events:
                    if not send(("event", event)) or run.cancelled.is_set():
                        break
            except BaseException as exc:
                send(("error", exc))
            finally:
                close = getattr(events, "close", None)
                if close is not None:
                    close()  # release the members' sessions now, not at garbage collection
                send(("end", None))

        # the caller's context variables (a server's request id in its log lines) follow the loop
        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(pump,), name="specem-astream", daemon=True
        )
        self._workers.add(worker)
        worker.start()
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "event":
                    yield payload
                elif kind == "error":
                    raise payload
                else:
                    break
        finally:
            run.cancelled.set()


def default_engine(*, backend: str | None = None, **config: Any) -> SpecEM:
    """The default preset's engine on ``backend`` (default: auto); the other keyword arguments are
    config fields over the preset's."""
    return SpecEM.from_preset(DEFAULT_PRESET, backend=backend, **config)


class _Run:
    """State of one request."""

    def __init__(
        self,
        members: Sequence[Member],
        config: SpecEMConfig,
        messages: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        constraint: CandidateFilter | None,
        prefill: str = "",
        prefill_choices: Sequence[str] = (),
        learned: MemberWeights | None = None,
    ) -> None:
        self.members = list(members)
        self.learned = learned
        self.prefill = prefill
        self.prefill_choices = list(prefill_choices)
        self.config = config
        self.messages = messages
        self.tools = list(tools) if tools else None
        self.constraint = constraint
        self.cancelled = threading.Event()
        self.sessions: dict[int, MemberSession] = {}
        self.excluded: list[Exclusion] = []
        self.usage = [MemberUsage(member=m.name) for m in self.members]
        self.exited: set[int] = set()
        self.trusted: int | None = None
        """The member the prior trusts most (:meth:`_trusted_drafter`), fixed at the start."""
        self.opening_drafter: int | None = None
        """The trusted member that drafts the first rounds alone (``trusted_opening_rounds``)."""
        self.text = ""
        self.segments: list[Segment] = []
        self.pool = MemberPool(self.members, config.parallel)
        self.sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            repetition_penalty=config.repetition_penalty,
            ignore_eos=config.ignore_eos,
            token_healing=config.token_healing,
            stop_at_line_end=config.segment_boundary == "line",
        )

    # -- failure handling -------------------------------------------------------------------
    def _call(self, stage: str, indices: Sequence[int], fn: Callable[[int], T], round_index: int) -> dict[int, T]:
        """Call ``fn`` for each member, retrying failures, excluding members that keep failing."""
        results: dict[int, T] = {}
        pending = list(indices)
        errors: dict[int, BaseException] = {}
        for _attempt in range(self.config.member_retries + 1):
            if not pending:
                break
            outcomes = self.pool.map(fn, pending, self.members)
            bad_input = next((out for out in outcomes if isinstance(out, InputError)), None)
            if bad_input is not None:  # the user's input, not the member, is at fault
                if stage == "open":  # nobody will use the sessions the other members opened
                    for out in [*results.values(), *outcomes]:
                        if isinstance(out, MemberSession):
                            with contextlib.suppress(Exception):
                                out.close()
                raise bad_input
            retry: list[int] = []
            for i, out in zip(pending, outcomes, strict=True):
                if isinstance(out, BaseException):
                    errors[i] = out
                    retry.append(i)
                else:
                    results[i] = out
            pending = retry
        for i in pending:
            self._exclude(i, stage, errors[i], round_index)
        return results

    def _exclude(self, i: int, stage: str, error: BaseException, round_index: int) -> None:
        message = f"{type(error).__name__}: {error}"
        self.excluded.append(Exclusion(self.members[i].name, stage, message, round_index))
        session = self.sessions.pop(i, None)
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()

    def _active(self) -> list[int]:
        return sorted(self.sessions)

    def _require_drafter(self) -> None:
        if not any(self.members[i].can_draft for i in self.sessions):
            reasons = "; ".join(f"{e.member} ({e.stage}): {e.error}" for e in self.excluded)
            raise AllMembersFailedError(f"every drafting member failed: {reasons or 'no drafter left'}", self.excluded)

    # -- the loop ---------------------------------------------------------------------------
    def events(self) -> Iterator[StreamEvent]:
        started = time.perf_counter()
        first_segment: float | None = None
        cfg = self.config
        emitted = 0
        announced = 0  # segments already carried by an event
        finish: FinishReason = "length"
        try:
            self._open_sessions()
            weights = self._initial_weights()
            if self.prefill:  # forced start of the answer (a tool call, a JSON object)
                self.text = self.prefill
                self._commit(self.prefill, 0, final=False)
            if self.prefill_choices:  # e.g. which tool a forced call names: the verifiers vote
                choice = self._vote_choice(self.prefill_choices)
                self.text += choice
                self._commit(choice, 0, final=False)
            trusted = self.trusted = self._trusted_drafter(weights)
            self.opening_drafter = trusted if cfg.trusted_opening_rounds else None
            exit_rule = (
                ModelExit(
                    cfg.exit_temperature,
                    cfg.exit_entropy_ratio,
                    cfg.exit_min_prob,
                    cfg.exit_min_rounds,
                    keep=trusted if cfg.exit_keep_trusted else None,
                    agreement_rounds=cfg.exit_agreement_rounds,
                )
                if cfg.model_exit
                else None
            )
            round_index = 0
            max_rounds = cfg.max_new_tokens + 8
            while True:
                if self.cancelled.is_set():
                    break
                remaining = cfg.max_new_tokens - self._completion_tokens()
                if remaining <= 0 or round_index >= max_rounds or not self._fits_context(cfg.segment_len):
                    finish = "length"
                    break
                round_index += 1
                t0 = time.perf_counter()
                step = self._round(round_index, min(cfg.segment_len, remaining), weights, exit_rule)
                if step is None:
                    finish = "length"
                    break
                segment, weights, ended = step
                old_len = len(self.text)
                self.text += segment.text
                stop_at = find_stop(self.text, cfg.stop, old_len)
                if stop_at is not None:
                    self.text = self.text[:stop_at]
                    segment.text = self.text[old_len:]
                    ended = True
                complete = getattr(self.constraint, "complete", None)
                if not ended and complete is not None and complete(self.text):
                    ended = True  # a JSON answer's object is closed: nothing but whitespace may follow
                self._commit(segment.text, round_index, final=ended)
                segment.seconds = time.perf_counter() - t0
                self.segments.append(segment)
                if first_segment is None:
                    first_segment = time.perf_counter() - started
                if ended:
                    finish = "stop"
                    break
                safe = len(self.text) - stop_holdback(self.text, cfg.stop)
                if safe > emitted or segment.text:
                    yield StreamEvent(delta=self.text[emitted:safe], segment=segment)
                    emitted = max(emitted, safe)
                    announced = len(self.segments)
            result = self._result(finish, started, first_segment)
            if self.learned is not None and cfg.hedge:
                self.learned.observe_result(self.segments)
            last = self.segments[-1] if len(self.segments) > announced else None
            yield StreamEvent(delta=self.text[emitted:], segment=last, done=True, result=result)
        finally:
            for i in list(self.sessions):
                with contextlib.suppress(Exception):
                    self.sessions.pop(i).close()
            self.pool.close()

    def _open_sessions(self) -> None:
        """Open every member's session before any model work: opening only renders, encodes and
        checks the context window (local members prefill on first use), so a prompt that does not
        fit one member raises :class:`ContextWindowError` before any member has spent time on it."""
        base_seed = self.config.seed

        def open_one(i: int) -> MemberSession:
            seed = None if base_seed is None else base_seed + 1_000_003 * i
            return self.members[i].open(SessionRequest(self.messages, self.tools, seed))

        gated = self._gate()
        opened = self._call("open", [i for i in range(len(self.members)) if i not in gated], open_one, 0)
        self.sessions.update(opened)
        self._require_drafter()
        for i, s in self.sessions.items():
            self.usage[i].prompt_tokens = s.prompt_tokens

    def _gate(self) -> set[int]:
        """Members the learned weights keep out of this request (``MemberWeights.min_share``),
        reported as exclusions at stage ``gate``; the best-weighted drafter always stays."""
        if self.learned is None:
            return set()
        verifiers = [i for i, m in enumerate(self.members) if m.can_verify]
        names = [self.members[i].name for i in verifiers]
        low = self.learned.gated(names)
        share = {i: low[self.members[i].name] for i in verifiers if self.members[i].name in low}
        if share and not any(m.can_draft for i, m in enumerate(self.members) if i not in share):
            del share[max((i for i in share if self.members[i].can_draft), key=share.__getitem__)]
        for i in sorted(share):
            reason = f"learned weight share {share[i]:.4f} is below min_share {self.learned.min_share:g}"
            self.excluded.append(Exclusion(self.members[i].name, "gate", reason, 0))
        return set(share)

    def _vote_choice(self, choices: list[str]) -> str:
        """The continuation the verifiers score best (uniform weights; ties → the first one)."""
        verifiers = [i for i in self._active() if self.members[i].can_verify]
        if len(choices) == 1 or not verifiers:
            return choices[0]
        cands = [Candidate("", c, False) for c in choices]
        scored = self._call("score", verifiers, lambda i: self.sessions[i].score(cands, score_eos=False), 0)
        rows: list[list[float]] = []
        for i in verifiers:
            if i not in scored or len(scored[i]) != len(cands):
                continue
            values, is_distribution = row_values(scored[i], self.config.scoring)
            rows.append(values if is_distribution else normalize_row(values, "softmax"))
        if not rows:
            return choices[0]
        return choices[argmax_first(combine(rows, [1.0 / len(rows)] * len(rows)))]

    def _initial_weights(self) -> dict[int, float]:
        verifiers = [i for i in self._active() if self.members[i].can_verify]
        if not verifiers:
            return {}
        if self.learned is not None:
            start = self.learned.start([self.members[i].name for i in verifiers])
            return dict(zip(verifiers, start, strict=True))
        return {i: 1.0 / len(verifiers) for i in verifiers}

    def _trusted_drafter(self, weights: dict[int, float]) -> int | None:
        """The drafter Model Exit never stops (``exit_keep_trusted``): the one with the highest
        prior in the member weights; among equal priors the larger model (``draft_cost``), then
        the higher starting weight. ``None`` without member weights or when a tie remains.

        The prior comes first because it is the evidence of correctness (e.g. accuracy on a
        labelled set), while what the weights learned comes from votes, i.e. likelihood, which
        favours a weaker member's more predictable text (docs/reports/quality.md, "Lessons
        learned")."""
        learned = self.learned
        if learned is None:
            return None
        ranked = sorted(
            ((learned.prior_of(self.members[i].name), _draft_cost(self.members[i]), w), i)
            for i, w in weights.items()
            if self.members[i].can_draft
        )
        if not ranked or (len(ranked) > 1 and ranked[-1][0] == ranked[-2][0]):
            return None
        return ranked[-1][1]

    def _completion_tokens(self) -> int:
        return self.sessions[self._active()[0]].completion_tokens if self.sessions else 0

    def _fits_context(self, extra: int) -> bool:
        for i, s in self.sessions.items():
            window = self.members[i].context_window
            if window and s.prompt_tokens + s.completion_tokens + extra + 2 > window:
                return False
        return True

    def _round(
        self,
        k: int,
        max_tokens: int,
        weights: dict[int, float],
        exit_rule: ModelExit | None,
    ) -> tuple[Segment, dict[int, float], bool] | None:
        cfg = self.config
        available = [i for i in self._active() if self.members[i].can_draft and i not in self.exited]
        if not available:  # every remaining drafter exited: bring them back rather than stall
            self.exited.clear()
            available = [i for i in self._active() if self.members[i].can_draft]
        solo = self._solo_drafter(k, available)
        call_opening = self._deciding_call_opening(k)
        drafting = [solo] if solo is not None else available
        drafts = self._draft(drafting, max_tokens, k)
        self._require_drafter()
        if solo is not None and not drafts:  # the trusted member failed and was excluded: the others draft
            solo = None
            drafting = [i for i in available if i in self.sessions]
            drafts = self._draft(drafting, max_tokens, k)
            self._require_drafter()
        if call_opening and solo is not None and solo in drafts and opens_call(drafts[solo].text):
            # the trusted member would call: whether the answer does is up to the others' openings too
            others = [i for i in available if i != solo and i in self.sessions]
            drafts.update(self._draft(others, max_tokens, k))
            self._require_drafter()
            drafting = [i for i in available if i in drafts]
        for i, d in drafts.items():
            self.usage[i].drafted_tokens += d.tokens
            self.usage[i].reused_tokens += d.reused
            self.usage[i].rounds_drafted += 1
        owners = [i for i in drafting if i in drafts and (drafts[i].text or drafts[i].ended)]
        if not owners:
            return None
        candidates = [
            Candidate(self.members[i].name, drafts[i].text, drafts[i].ended, drafts[i].tokens) for i in owners
        ]
        if cfg.segment_boundary == "line":  # a drafter that ran past its first line end is cut there
            candidates = [to_line_end(c) for c in candidates]
        if self.constraint is not None:
            owners, candidates = constrain(self.constraint, self.text, owners, candidates, self._vote_choice)
        if call_opening:
            owners, candidates = self._unanimous_call_opening(owners, candidates, solo)

        verifiers = [i for i in self._active() if self.members[i].can_verify]
        raw: list[list[float]] = []
        normalized: list[list[float]] = []
        if len(candidates) > 1 and verifiers:
            scored_cands, copies, index = distinct(candidates)

            def score_one(i: int) -> list[CandidateScore]:
                row = self.sessions[i].score(scored_cands, score_eos=cfg.eos_voting)
                if len(row) != len(scored_cands):
                    raise MemberError(self.members[i].name, "scoring", f"{len(row)} scores for {len(scored_cands)}")
                row_values(row, cfg.scoring)  # unusable rows fail here, so the member is retried/excluded
                return row

            scored = self._call("score", verifiers, score_one, k)
            verifiers = [i for i in verifiers if i in scored]
            raw, normalized = score_rows([scored[i] for i in verifiers], copies, index, cfg)
        weights = {i: w for i, w in weights.items() if i in self.sessions}
        vote = tally(normalized, verifiers, owners, candidates, weights, cfg, k, learned=self.learned is not None)
        combined, winner = vote.combined, vote.winner
        if cfg.trusted_veto and raw:
            winner = self._veto(winner, owners, verifiers, candidates, raw)
        if exit_rule is not None and solo is None:  # an unvoted round is no evidence for exit
            per_member = {owners[n]: combined[n] for n in range(len(owners))}
            texts = {owners[n]: (c.text, c.ended) for n, c in enumerate(candidates)}
            for i in exit_rule.update(k, drafting, per_member, texts):
                self.exited.add(i)
        segment = Segment(
            index=k,
            text=candidates[winner].text,
            winner=candidates[winner].member,
            winner_index=winner,
            candidates=candidates,
            drafters=[self.members[i].name for i in drafting],
            verifiers=[self.members[i].name for i in verifiers] if normalized else [],
            raw_scores=raw,
            normalized=normalized,
            weights=vote.row_weights if normalized else [],
            combined=combined,
            rewards=vote.rewards,
            learning_rate=vote.learning_rate,
        )
        return segment, vote.weights, candidates[winner].ended

    def _solo_drafter(self, k: int, available: Sequence[int]) -> int | None:
        """The trusted member when it writes this round alone: the opening
        (``trusted_opening_rounds``), or the rest of a tool call the answer has started
        (``trusted_tool_calls``)."""
        cfg = self.config
        if k <= cfg.trusted_opening_rounds and self.opening_drafter in available:
            return self.opening_drafter
        trusted = self.trusted
        if (
            cfg.trusted_tool_calls
            and self.tools
            and trusted is not None
            and trusted in self.sessions  # a drafter (_trusted_drafter) not excluded since
            and call_in_progress(self.text)
        ):
            return trusted
        return None

    def _deciding_call_opening(self, k: int) -> bool:
        """Whether this round decides if the answer opens with a tool call or in words
        (``unanimous_tool_calls``): the first round of an answer that may call a tool (tools
        offered, nothing forced)."""
        return self.config.unanimous_tool_calls and k == 1 and bool(self.tools) and not self.text

    def _unanimous_call_opening(
        self, owners: list[int], candidates: list[Candidate], solo: int | None
    ) -> tuple[list[int], list[Candidate]]:
        """``unanimous_tool_calls``: the openings that start a call are dropped when another
        opening is words; then the trusted member's opening, when it drafts the opening alone
        (``trusted_opening_rounds``) and is among those left, is the only one. (When it drafts
        alone and opens in words, the others were not asked: their openings could not change it.)
        An opening that repeats the prompt's tool listing is not words: a member that starts to
        write out the tools it was shown is not answering without them."""
        calls = [opens_call(c.text) for c in candidates]
        words = [
            n for n, c in enumerate(candidates) if c.text.strip() and not calls[n] and not opens_tool_listing(c.text)
        ]
        keep = words if words and any(calls) else list(range(len(candidates)))
        if solo is not None and solo in owners and owners.index(solo) in keep:
            keep = [owners.index(solo)]
        return [owners[n] for n in keep], [candidates[n] for n in keep]

    def _veto(
        self,
        winner: int,
        owners: Sequence[int],
        verifiers: Sequence[int],
        candidates: Sequence[Candidate],
        raw: Sequence[Sequence[float]],
    ) -> int:
        """``trusted_veto``: the vote's winner stands when the trusted member drafted it, or scores
        it at least as high as its own draft; otherwise the trusted member's draft wins."""
        trusted = self.trusted
        if trusted is None or trusted not in owners or trusted not in verifiers:
            return winner
        own = owners.index(trusted)
        if (candidates[winner].text, candidates[winner].ended) == (candidates[own].text, candidates[own].ended):
            return winner
        row = raw[verifiers.index(trusted)]
        return winner if row[winner] >= row[own] else own

    def _draft(self, drafting: list[int], max_tokens: int, k: int) -> dict[int, Draft]:
        """Every drafter's draft. Drafters that would run one after another anyway (one device)
        take turns cheapest first, each shown the candidates drafted before it
        (``SpecEMConfig.draft_hints``); otherwise they draft concurrently, without hints."""
        cfg = self.config
        members = self.members
        if not cfg.draft_hints or len(drafting) < 2 or self.pool.concurrent(drafting):
            return self._call("draft", drafting, lambda i: self.sessions[i].draft(max_tokens, self.sampling), k)
        drafts: dict[int, Draft] = {}
        for i in sorted(drafting, key=lambda i: (_draft_cost(members[i]), i)):
            hints = [Candidate(members[j].name, d.text, d.ended, d.tokens) for j, d in drafts.items() if d.text]

            def draft_one(i: int, hints: list[Candidate] = hints) -> Draft:
                return self.sessions[i].draft(max_tokens, self.sampling, hints=hints, score_eos=cfg.eos_voting)

            drafts.update(self._call("draft", [i], draft_one, k))
        return {i: drafts[i] for i in drafting if i in drafts}

    def _commit(self, text: str, round_index: int, final: bool) -> None:
        if not text:
            return
        # On the final segment members only count tokens: nobody continues from it.
        self._call("commit", self._active(), lambda i: self.sessions[i].commit(text, final=final), round_index)
        if not final:
            self._require_drafter()

    def _result(self, finish: FinishReason, started: float, first_segment: float | None) -> GenerationResult:
        for i, s in self.sessions.items():
            self.usage[i].completion_tokens = s.completion_tokens
            self.usage[i].cached_tokens = getattr(s, "cached_tokens", 0)  # local members' prefix caches
            self.usage[i].prefilled_tokens = getattr(s, "prefilled_tokens", 0)
        ref = next((u for i, u in enumerate(self.usage) if i in self.sessions), self.usage[0])
        return GenerationResult(
            text=self.text,
            finish_reason=finish,
            usage=Usage(ref.prompt_tokens, ref.completion_tokens, list(self.usage)),
            segments=self.segments,
            members=[m.name for m in self.members],
            excluded=list(self.excluded),
            seconds=time.perf_counter() - started,
            first_segment_seconds=first_segment,
            config=self.config.to_dict(),
        )


def _draft_cost(member: Member) -> float:
    """Relative cost of one drafted token (``member.draft_cost`` where a backend knows it, e.g.
    the GGUF's size; 0 otherwise, which keeps the member order)."""
    cost = getattr(member, "draft_cost", None)
    return float(cost) if isinstance(cost, int | float) else 0.0
