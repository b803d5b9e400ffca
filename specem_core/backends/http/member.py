"""Members behind OpenAI-compatible HTTP servers (vLLM, SGLang, llama.cpp, hosted APIs).

This is how an ensemble scales past one machine: every base model runs on its own server (or
cluster) and SpecEM only orchestrates. One :class:`OpenAIHTTPMember` talks to one server through
one :class:`~specem_core.backends.http.client.OpenAIClient` (transport, retries, secrets).

**Drafting** continues the committed response ``R`` exactly:

* ``completions`` — ``/v1/completions`` on the member's own chat-formatted prompt plus ``R``. The
  template comes from a local tokenizer (a tokenizer object, a Hugging Face tokenizer directory
  or id; the registry turns the name of a packaged default model into its converted cache) or a
  Jinja ``chat_template``; without one, the plain format of :mod:`specem_core.chat_format`.
* ``chat_prefill`` — ``/v1/chat/completions`` with ``R`` as a trailing assistant message and
  vLLM's ``continue_final_message`` (probed: llama-cpp-python ignores it and starts a new turn).
* ``chat_continue`` — for chat APIs that cannot prefill: the partial answer is shown back with
  :data:`~specem_core.backends.http.continuation.CONTINUE_PROMPT`, the model is asked to repeat
  its last words and go on, and the reply is spliced onto ``R`` at that overlap
  (:mod:`specem_core.backends.http.continuation`).

Without a local template, a member whose served model id names something on this machine takes
the template from there (``template_resolver``: :func:`specem_core.registry.served_model_template`
resolves a packaged model's name from the template its GGUF carries, a local ``.gguf`` file, a
tokenizer directory or an HF id in the local cache), and a server that renders conversations
itself (vLLM's ``/tokenize`` with messages, then ``/detokenize``) gives the prompt text
(``prompt_source="server"``): either way drafts go through ``/v1/completions`` and continue the
committed tokens. Only without both does a member draft through chat completions, and it says so
at start-up (a warning naming ``tokenizer=``).

**Verification** (``verify_mode="logprobs"``, or ``auto``) scores a candidate exactly: the mean
log-prob of its tokens after ``prompt + R``, on the fastest exact path the probe found
(:data:`~specem_core.backends.http.probe.ScorePath`, in :attr:`ServerCapabilities.score_paths`;
``verify_mode="echo"`` / ``"prompt_tail"`` / ``"next_token"`` / ``"forced"`` forces one).
``prompt_tail`` and ``next_token`` (vLLM) and ``forced`` (llama-cpp-python) read the server's prefix
cache
(:mod:`specem_core.backends.http.token_scoring`); ``echo`` sends ``prompt + R + candidate
[+ end-of-turn]`` with ``echo`` + ``logprobs``, locates the candidate's tokens by character offsets
(:mod:`specem_core.backends.http.alignment`) and costs a whole prompt every time. Servers expose
log-probs, not raw logits, so an HTTP verifier's row is ``softmax(mean log-probs)`` over the
candidates (reported as ``CandidateScore.probability``; ``mean_logprob`` is filled too,
``mean_logit`` is ``None``). ``verify_mode="judge"`` asks the model to pick the best labelled
candidate instead (:func:`~specem_core.backends.http.judge_scoring.judge_scores`, prompts in
:mod:`specem_core.backends.http.judge_prompt`; :class:`~specem_core.backends.http.judge.APIJudgeMember`
is a member that only judges).

**Probing.** At its first request each member asks its server what drafting needs, and how it
scores only when it first scores (never, for a member alone); the answers are kept per server, in
the process and on disk (:mod:`~specem_core.backends.http.probe_cache`). The requests are
:mod:`~specem_core.backends.http.probing`'s, what they decide (echo alignment, shifted servers,
``max_tokens=0``, prefill, the scoring paths) :mod:`~specem_core.backends.http.probe`'s, the modes
:mod:`~specem_core.backends.http.modes`'. A shifted echo is corrected from the previous slot's
``top_logprobs``; a token missing there, an alignment that cannot be established, or a response
whose greedy token contradicts the probed alignment raises
:class:`~specem_core.backends.http.errors.AlignmentError` (or, for missing tokens with
``strict_scoring=False``, uses the slot's lowest listed log-prob as a bound and counts it in
``member.stats``). Nothing is mis-scored silently.

This module holds the member (configuration, probing requests, request bodies in the server's
dialect); each request's drafting and scoring is :mod:`specem_core.backends.http.session`'s, the
probe's requests :mod:`specem_core.backends.http.probing`'s, what they decide
:mod:`specem_core.backends.http.probe`'s, the local tokenizer
:mod:`specem_core.backends.http.tokenizer`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from specem_core.backends.base import SamplingParams, SessionRequest, Verification
from specem_core.backends.http import probe_cache, probing
from specem_core.backends.http.client import (
    BreakerPolicy,
    CircuitBreaker,
    OpenAIClient,
    RetryPolicy,
    event_loop,
    log,
    run_async,
    run_sync,
)
from specem_core.backends.http.errors import HTTPMemberError, ServerResponseError
from specem_core.backends.http.interface import MemberStats
from specem_core.backends.http.judge_prompt import JudgeOptions
from specem_core.backends.http.modes import draft_mode_for, verify_mode_for, warn_plain_prompt
from specem_core.backends.http.probe import (
    PROBE_QUESTION,
    SCORE_PATHS,
    DraftMode,
    PromptSource,
    ScorePath,
    ServerCapabilities,
    ServerKind,
    VerifyMode,
    context_from_models,
    is_fatal,
    server_kind,
    without_scoring,
)
from specem_core.backends.http.probe_cache import ProbeKey, member_fingerprint
from specem_core.backends.http.session import OpenAIHTTPSession
from specem_core.backends.http.tokenizer import TemplateOnly, end_of_turn_token, load_tokenizer, stop_token_ids
from specem_core.chat_format import ChatFormat, flatten_tool_turns, render_plain, with_tool_instructions


class OpenAIHTTPMember:
    """A model behind an OpenAI-compatible server, as a SpecEM member.

    Example:
        >>> member = OpenAIHTTPMember("http://gpu-1:8000/v1", "Qwen/Qwen2.5-7B-Instruct",
        ...                           tokenizer="Qwen/Qwen2.5-7B-Instruct")     # doctest: +SKIP
        >>> member.probe().echo_shift                                           # doctest: +SKIP
        0

    Args:
        base_url: API root (``http://host:port/v1``).
        model: the served model id (default: the first one ``/v1/models`` lists).
        name: unique name in the ensemble (default: the model id).
        api_key, headers, timeout, retry: see :class:`OpenAIClient`.
        can_draft, can_verify: roles in the ensemble.
        draft_mode: ``auto`` picks ``completions`` when the prompt text is exact (a chat template
            known locally, or rendered by the server), else ``chat_prefill`` when the server
            supports it, else ``chat_continue``, else plain-format completions.
        verify_mode: ``auto`` scores exactly on the fastest path the server offers and falls back
            to ``judge``; ``logprobs`` insists on an exact path; ``echo``, ``prompt_tail``,
            ``next_token`` or ``forced`` names one (:data:`~specem_core.backends.http.probe.ScorePath`); a member
            whose server supports none stops verifying (logged).
        tokenizer: a tokenizer object, a tokenizer directory or a Hugging Face id: the source of
            the chat template (and of exact token counts). For a packaged model name
            (``"smollm2"``) pass :func:`specem_core.registry.resolve_tokenizer` of it, or build the
            member with ``load_member("openai:…", tokenizer="smollm2")``, which does that.
        chat_template: a Jinja template (overrides the tokenizer's).
        template_resolver: called with the served model id when neither ``tokenizer`` nor
            ``chat_template`` is given: a tokenizer (or a directory / id to load one from) or
            ``None`` (:func:`specem_core.registry.load_member` passes
            :func:`~specem_core.registry.served_model_template`).
        server_prompt: without a local template, let a server that renders conversations give the
            prompt text (vLLM); ``False`` keeps the plain format (the behaviour before it did).
        end_of_turn: the end-of-turn token text for EOS voting (default: from the tokenizer).
        context_window: tokens the server accepts (default: what ``/v1/models`` reports).
        capabilities: skip probing and use these.
        top_logprobs: how many alternatives to request per position (shift correction, judge).
        judge: options of the judge mode (:class:`specem_core.backends.http.judge_prompt.JudgeOptions`).
        extra_body: fields merged into every request body (server-specific knobs).
        strict_scoring: raise instead of bounding a log-prob a shifted server did not list.
        transport: ``httpx`` transport (``httpx.MockTransport`` in tests).
        breaker: the circuit breaker policy of this member's server
            (:class:`~specem_core.backends.http.client.BreakerPolicy`): while the server is down the
            member is excluded from requests at once, and used again once a probe gets an answer.
        probe_cache: keep what the probe finds on disk too, so that a new process asks the server
            nothing it asked before (:mod:`~specem_core.backends.http.probe_cache`; ``False``: in
            this process only, as ``SPECEM_PROBE_CACHE=0`` does for every member).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        name: str | None = None,
        api_key: str | SecretStr | None = None,
        headers: Mapping[str, str | SecretStr] | None = None,
        timeout: float | httpx.Timeout = 120.0,
        retry: RetryPolicy | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        draft_mode: DraftMode = "auto",
        verify_mode: VerifyMode = "auto",
        tokenizer: Any = None,
        chat_template: str | None = None,
        template_resolver: Callable[[str], Any] | None = None,
        server_prompt: bool = True,
        end_of_turn: str | None = None,
        context_window: int | None = None,
        capabilities: ServerCapabilities | None = None,
        server: ServerKind | None = None,
        top_logprobs: int = 20,
        judge: JudgeOptions | None = None,
        extra_body: Mapping[str, Any] | None = None,
        strict_scoring: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 32,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        breaker: BreakerPolicy | None = None,
        probe_cache: bool = True,
    ) -> None:
        if draft_mode not in ("auto", "completions", "chat_prefill", "chat_continue"):
            raise ValueError(f"unknown draft_mode {draft_mode!r}")
        if verify_mode not in ("auto", "logprobs", "judge", *SCORE_PATHS):
            raise ValueError(f"unknown verify_mode {verify_mode!r}")
        self.client = OpenAIClient(
            base_url,
            api_key=api_key,
            headers=headers,
            timeout=timeout,
            retry=retry,
            transport=transport,
            max_connections=max_connections,
            sleep=sleep,
            breaker=breaker,
        )
        self.base_url = self.client.base_url
        self.model = model
        self.name = name or model or _default_name(self.base_url)
        self.can_draft = can_draft
        self.can_verify = can_verify
        self.draft_mode: DraftMode = draft_mode
        self.verify_mode: VerifyMode = verify_mode
        self.top_logprobs = top_logprobs
        self.extra_body = dict(extra_body or {})
        self.strict_scoring = strict_scoring
        self._server_override = server
        self._context_window = context_window
        self.stats = MemberStats()
        """This member's counters over its life (requests, cached prompt tokens, inexact scores)."""
        self.tokenizer: Any = None
        self.chat: ChatFormat | None = None
        self.end_of_turn: str | None = None
        self._stop_ids: list[int] = []
        self._end_of_turn_arg = end_of_turn
        self._template_resolver = template_resolver if tokenizer is None and chat_template is None else None
        self._server_prompt = server_prompt
        self._use_tokenizer(tokenizer, chat_template)
        self.judge_options: JudgeOptions = judge if judge is not None else JudgeOptions()
        # given capabilities are the whole answer: nothing is asked, scoring included
        self._caps = replace(capabilities, scoring_probed=True) if capabilities is not None else None
        self._kind: ServerKind = "generic"
        self._probe_lock = threading.Lock()
        self._scoring_lock = threading.Lock()
        """Guards starting the scoring probe; never held while waiting for the event loop (the
        loop's own requests take it)."""
        self._probe_cache = probe_cache
        self._probe_key: ProbeKey | None = None
        self._cached = False
        """The capabilities came from the probe cache (a refused path then forgets them)."""
        self._draft: DraftMode | None = None
        self._verify: VerifyMode | None = None
        self._verify_resolved = False
        self._scoring: concurrent.futures.Future[ServerCapabilities] | None = None
        """The scoring half of the probe, once started (shared by every request that waits for it)."""
        self.score_path: ScorePath | None = None
        """The exact scoring path in use (resolved by the probe; ``None`` for the judge)."""
        self.prompt_source: PromptSource = "local" if self.chat is not None else "plain"
        """Where the prompt text comes from (resolved by the probe)."""

    def _use_tokenizer(self, tokenizer: Any, chat_template: str | None) -> None:
        """Take the chat template (and token counts) from ``tokenizer`` / ``chat_template``."""
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        if tokenizer is None and chat_template is not None:
            tokenizer = TemplateOnly(chat_template)
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer, chat_template) if tokenizer is not None else None
        if self.chat is not None and not self.chat.uses_template:
            self.chat = None if isinstance(tokenizer, TemplateOnly) else self.chat
        self.end_of_turn = self._end_of_turn_arg or (end_of_turn_token(self.chat, tokenizer) if self.chat else None)
        self._stop_ids = stop_token_ids(tokenizer, self.end_of_turn)

    # -- Member protocol ---------------------------------------------------------------------
    @property
    def context_window(self) -> int | None:
        """Tokens the server accepts, when known (argument, or ``/v1/models``)."""
        if self._context_window is not None:
            return self._context_window
        return self._caps.context_window if self._caps is not None else None

    @property
    def concurrency_key(self) -> str:
        """One key per server: members on different servers run concurrently."""
        parts = urlsplit(self.base_url)
        return f"http:{parts.netloc}{parts.path}"

    @property
    def breaker(self) -> CircuitBreaker:
        """The circuit breaker of this member's server (:class:`~specem_core.backends.base.BreakerMember`)."""
        return self.client.breaker

    @property
    def verification(self) -> Verification | None:
        """How this member verifies (:class:`~specem_core.backends.base.VerificationMember`):
        ``exact`` (a scoring path: ``score_path``), ``judge`` (approximate: the member's
        ``verify_mode`` asked for it, or ``auto`` found no exact path and warned), ``none``;
        ``None`` before its server was asked how it scores (a member alone never is)."""
        if not self.can_verify:
            return "none"
        if not self._verify_resolved:
            return None
        return "judge" if self._verify == "judge" else "exact"

    @property
    def capabilities(self) -> ServerCapabilities | None:
        """The probed (or given) capabilities; ``None`` before the first probe."""
        return self._caps

    def open(self, request: SessionRequest) -> OpenAIHTTPSession:
        """Probe what drafting needs once (first request), then start a session; how the server
        scores is asked when the request first scores (never for a member alone), started beside
        the first draft where the server runs requests side by side (vLLM, SGLang)."""
        self.probe(scoring=False)
        if request.scores and self.can_verify and self._server() in ("vllm", "sglang"):
            self._scoring_probe()
        return OpenAIHTTPSession(self, request)

    def __repr__(self) -> str:
        return (
            f"OpenAIHTTPMember(name={self.name!r}, base_url={self.base_url!r}, model={self.model!r}, "
            f"draft={self.can_draft}, verify={self.can_verify})"
        )

    def close(self) -> None:
        """Close the connection pool (the member can still be used: it reopens on demand)."""
        run_sync(self.client.aclose())

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        await run_async(self.client.aclose())

    def __enter__(self) -> OpenAIHTTPMember:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- modes ------------------------------------------------------------------------------
    @property
    def modes(self) -> tuple[DraftMode, VerifyMode | None]:
        """The resolved (draft, verify) modes; probes first if needed."""
        self.probe()
        assert self._draft is not None
        return self._draft, self._verify

    @property
    def draft_mode_in_use(self) -> DraftMode:
        """How this member drafts (probes what drafting needs first, if needed)."""
        self.probe(scoring=False)
        assert self._draft is not None
        return self._draft

    def probe(self, *, force: bool = False, scoring: bool = True) -> ServerCapabilities:
        """Find out what the server supports (once; thread-safe) and resolve the modes.

        The answers are cached per server (:mod:`~specem_core.backends.http.probe_cache`): in this
        process and on disk, so a new process asks nothing it asked before. ``scoring=False`` asks
        only what drafting needs (a member alone never scores); ``force`` asks again.

        Raises:
            HTTPMemberError: the server is unreachable.
            CapabilityError: an explicitly requested mode is not supported.
        """
        with self._probe_lock:
            if self._caps is None or force:
                if force and self._probe_key is not None:
                    probe_cache.forget(self._probe_key)
                self._caps = run_sync(self._aprobe_drafting(force=force))
                self._draft = None
                if force:
                    self._scoring, self._verify_resolved = None, False
            if self._draft is None:
                self._draft = self._resolve_draft(self._caps)
            if self._caps.scoring_probed and not self._verify_resolved:  # from the probe cache
                self._verify, self._verify_resolved = self._resolve_verify(self._caps), True
        if scoring and self.can_verify:
            return self._scoring_probe().result()
        return self._caps

    def _scoring_probe(self) -> concurrent.futures.Future[ServerCapabilities]:
        """The scoring half of the probe, started once on the members' event loop (a failed one
        is started again by the next caller)."""
        with self._scoring_lock:
            running = self._scoring
            if running is None or (running.done() and (running.cancelled() or running.exception() is not None)):
                running = self._scoring = asyncio.run_coroutine_threadsafe(self._aprobe_scoring(), event_loop())
            return running

    @property
    def probe_was_cached(self) -> bool:
        """Whether the capabilities in use came from the probe cache (not asked in this process)."""
        return self._cached

    @property
    def known_verify_mode(self) -> tuple[bool, VerifyMode | None]:
        """(resolved, the verify mode): known without a request once the server was asked how it
        scores, in this process or before (the probe cache)."""
        return self._verify_resolved, self._verify

    async def averify_mode(self) -> VerifyMode | None:
        """How this member verifies, asking its server how it scores first if nobody has (from the
        members' event loop; a cancelled request does not cancel the probe others wait for)."""
        if self.can_verify:
            await asyncio.shield(asyncio.wrap_future(self._scoring_probe()))
        return self._verify if self.can_verify else None

    async def reprobe_scoring(self) -> VerifyMode | None:
        """Ask the server how it scores again (a cached scoring path was refused: the server was
        restarted with other flags): forgets the cached answer, logs it and resolves the mode anew."""
        with self._scoring_lock:
            if self._probe_key is not None:
                probe_cache.forget(self._probe_key)
            if self._caps is not None:
                self._caps = without_scoring(self._caps)
            self._scoring, self._verify_resolved, self._cached = None, False, False
        log.warning("%s: the server refused the scoring path its cached probe named; probing it again", self.name)
        return await self.averify_mode()

    def _resolve_draft(self, caps: ServerCapabilities) -> DraftMode:
        if self.model is None and caps.model is not None:
            self.model = caps.model
        self.prompt_source = self.prompt_source_for(caps)
        draft = draft_mode_for(self.name, self.draft_mode, self.can_draft, caps, self.prompt_source)
        if self.prompt_source == "plain" and self.can_draft:
            warn_plain_prompt(self.name, self.model, draft)
        return draft

    def _resolve_verify(self, caps: ServerCapabilities) -> VerifyMode | None:
        self.score_path = None
        if not self.can_verify:
            return None
        verify, self.score_path = verify_mode_for(self.name, self.verify_mode, caps)
        if verify is None:
            self.can_verify = False
        if self.prompt_source == "plain" and verify == "logprobs" and not self.can_draft:
            warn_plain_prompt(self.name, self.model, None)
        return verify

    # -- request bodies ----------------------------------------------------------------------
    def _server(self) -> ServerKind:
        if self._server_override is not None:
            return self._server_override
        if self._caps is not None:
            return self._caps.server
        return self._kind

    def sampling_body(self, sampling: SamplingParams, seed: int | None) -> dict[str, Any]:
        """Sampling fields in the dialect of the server (unknown fields are not sent to strict APIs)."""
        body: dict[str, Any] = {"temperature": float(sampling.temperature)}
        if sampling.top_p < 1.0:
            body["top_p"] = sampling.top_p
        if seed is not None:
            body["seed"] = seed
        kind = self._server()
        if kind in ("llama-cpp-python", "llama.cpp"):
            body["top_k"] = sampling.top_k  # <= 0 disables; the server's default is 40
            body["min_p"] = 0.0  # the server's default is 0.05
            body["repeat_penalty"] = sampling.repetition_penalty  # the server's default is 1.1
            if sampling.ignore_eos and self._stop_ids:
                body["logit_bias"] = {str(i): -100.0 for i in self._stop_ids}
        elif kind in ("vllm", "sglang"):
            if sampling.top_k > 0:
                body["top_k"] = sampling.top_k
            if sampling.repetition_penalty != 1.0:
                body["repetition_penalty"] = sampling.repetition_penalty
            if sampling.ignore_eos:
                body["ignore_eos"] = True
        return body

    def greedy_body(self) -> dict[str, Any]:
        return self.sampling_body(SamplingParams(), None)

    def body(self, **fields: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.model is not None:
            out["model"] = self.model
        out.update(fields)
        out.update(self.extra_body)
        return out

    @property
    def add_special_tokens(self) -> bool:
        """Whether a text prompt gets the tokenizer's special tokens (BOS) added: not when a chat
        template wrote them (vLLM's ``add_special_tokens``; llama.cpp servers decide themselves)."""
        return self.prompt_source == "plain"

    def completion_fields(self) -> dict[str, Any]:
        """Fields every text-prompt ``/v1/completions`` request carries in the server's dialect."""
        if self._server() == "vllm" and not self.add_special_tokens:
            return {"add_special_tokens": False}
        return {}

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> str:
        """The member's own prompt text (chat template when known, else the plain format)."""
        if self.chat is not None:
            return self.chat.render(messages, tools)
        msgs = [dict(m) for m in messages]
        if tools:
            msgs = with_tool_instructions(flatten_tool_turns(msgs), tools)
        return render_plain(msgs)

    def chat_messages(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[dict[str, Any]]:
        """Messages for chat endpoints: tool schemas as text (calls are parsed from the text)."""
        msgs = flatten_tool_turns(messages)
        return with_tool_instructions(msgs, tools) if tools else msgs

    # -- probing -----------------------------------------------------------------------------
    async def _aprobe_drafting(self, *, force: bool = False) -> ServerCapabilities:
        """What drafting needs: the server software and model (``/v1/models``), the chat template,
        the server's tokenizer endpoint, completions or chat completions; from the probe cache when
        this server was asked before (``/v1/models`` and the version are always asked: they key it)."""
        client = self.client
        notes: list[str] = []
        kind: ServerKind = "generic"
        entries: list[dict[str, Any]] = []
        try:
            kind, entries = server_kind(await client.request_json("GET", "/models", retries=1))
        except ServerResponseError:
            notes.append("/models answered with an unexpected body")
        except HTTPMemberError as exc:
            if is_fatal(exc):  # unreachable, unauthorized, overloaded: nothing else will work either
                raise
            notes.append(f"/models unavailable ({exc.status})")
        if self._server_override is not None:
            kind = self._server_override
        self._kind = kind
        model = self.model
        if model is None and entries:
            first = entries[0].get("id")
            model = str(first) if first is not None else None
            self.model = model
        if self.chat is None and self._template_resolver is not None and model:
            # loading a tokenizer takes seconds of CPU: off the loop every member's requests share
            found = await asyncio.to_thread(self._template_resolver, model)
            if found is not None:
                await asyncio.to_thread(self._use_tokenizer, found, None)
                if self.chat is not None:
                    notes.append(f"chat template of {model!r} found on this machine")
        self._probe_key = ProbeKey(
            base_url=self.base_url,
            model=model,
            server=kind,
            version=await probing.server_version(self, kind),
            member=self._fingerprint(),
        )
        cached = None if force else probe_cache.load(self._probe_key, disk=self._probe_cache)
        if cached is not None:
            self._cached = True
            return cached
        self._cached = False
        caps = ServerCapabilities(server=kind, model=model, context_window=context_from_models(entries, model))
        caps = replace(caps, notes=tuple(notes))
        caps = await probing.probe_drafting(self, caps, self.can_draft)
        probing.check_model_served(self.name, model, entries, caps, self.can_draft)
        for note in caps.notes:
            log.info("%s: %s", self.name, note)
        probe_cache.store(self._probe_key, caps, disk=self._probe_cache)
        return caps

    async def _aprobe_scoring(self) -> ServerCapabilities:
        """How the server scores: its exact scoring paths, fastest first, echo log-probs and chat
        log-probs (the judge), each asked only where this member's ``verify_mode`` may use it and
        with requests of a few tokens; then the verify mode is resolved (and cached)."""
        caps = self._caps
        assert caps is not None, "the drafting probe runs first"
        if caps.scoring_probed:
            if not self._verify_resolved:
                self._verify, self._verify_resolved = self._resolve_verify(caps), True
            return caps
        known = len(caps.notes)
        caps = await probing.probe_scoring(self, caps)
        caps = replace(caps, scoring_probed=True)
        for note in caps.notes[known:]:
            log.info("%s: %s", self.name, note)
        self._caps = caps
        self._verify, self._verify_resolved = self._resolve_verify(caps), True
        if self._probe_key is not None:
            probe_cache.store(self._probe_key, caps, disk=self._probe_cache)
        return caps

    def _fingerprint(self) -> str:
        """This member's side of the probe (the probe cache's key)."""
        prompt = self.render_prompt([{"role": "user", "content": PROBE_QUESTION}], None)
        return member_fingerprint(
            prompt=prompt,
            draft_mode=self.draft_mode,
            verify_mode=self.verify_mode,
            can_draft=self.can_draft,
            server_prompt=self._server_prompt,
            top_logprobs=self.top_logprobs,
            extra_body=self.extra_body,
        )

    def prompt_source_for(self, caps: ServerCapabilities) -> PromptSource:
        """Where the prompt text comes from with these capabilities (see :attr:`prompt_source`)."""
        if self.chat is not None:
            return "local"
        return "server" if caps.renders_messages and self._server_prompt else "plain"


def _default_name(base_url: str) -> str:
    parts = urlsplit(base_url)
    return parts.netloc or base_url
