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
  :data:`CONTINUE_PROMPT`, the model is asked to repeat its last words and go on, and the reply is
  spliced onto ``R`` at that overlap (:func:`splice_continuation`).

**Verification** (``verify_mode="logprobs"``) scores a candidate exactly where the server exposes
prompt log-probs (``echo`` + ``logprobs`` on ``/v1/completions``; vLLM and llama-cpp-python do):
the request is ``prompt + R + candidate [+ end-of-turn]``, the candidate's tokens are located by
character offsets (:mod:`specem_core.backends.http.alignment`), and the mean log-prob of exactly
those tokens is the score. Servers expose log-probs, not raw logits, so an HTTP verifier's row is
``softmax(mean log-probs)`` over the candidates (reported as ``CandidateScore.probability``;
``mean_logprob`` is filled too, ``mean_logit`` is ``None``). ``verify_mode="judge"`` asks the
model to pick the best labelled candidate instead (:func:`judge_scores`, prompts in
:mod:`specem_core.backends.http.judge_prompt`; :class:`~specem_core.backends.http.judge.APIJudgeMember`
is a member that only judges).

**Probing.** Before the first request (or on :meth:`OpenAIHTTPMember.probe`) each server is
probed with a prompt in the member's own format and a known continuation (counting): whether echo
log-probs are aligned with their tokens or shifted by one position (llama-cpp-python pairs each
prompt token with the distribution *after* it unless the prompt started with BOS), what
``max_tokens=0`` means (vLLM: nothing generated; llama-cpp-python: unlimited), whether assistant
prefill works and whether chat log-probs exist. A shifted server is corrected by reading each
token's log-prob from the previous slot's ``top_logprobs``; a token missing there, an alignment
that cannot be established, or a response whose own greedy token contradicts the probed alignment
raises :class:`~specem_core.backends.http.errors.AlignmentError` (or, for missing tokens with
``strict_scoring=False``, uses the slot's lowest listed log-prob as a bound and counts it in
``member.stats``). Nothing is mis-scored silently.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr

from specem_core.backends.base import MemberSession, SamplingParams, SessionRequest
from specem_core.backends.http.alignment import (
    EchoAlignment,
    EchoLogprobs,
    _first_choice,
    _near_tie,
    _num,
    _top1,
    align_echo,
    parse_echo_logprobs,
    span_logprobs,
)
from specem_core.backends.http.client import (
    BreakerPolicy,
    Inflight,
    OpenAIClient,
    RetryPolicy,
    _gather,
    log,
    run_async,
    run_sync,
)
from specem_core.backends.http.errors import (
    AlignmentError,
    CapabilityError,
    HTTPMemberError,
    RequestCancelledError,
    ServerResponseError,
)
from specem_core.backends.http.judge_prompt import (
    LABELS,
    JudgeOptions,
    _nonce,
    addresses_judge,
    judge_messages,
    judge_orders,
    label_probabilities,
)
from specem_core.chat_format import (
    PLAIN_TURN_STOPS,
    ChatFormat,
    JinjaChatTemplate,
    flatten_tool_turns,
    render_plain,
    with_tool_instructions,
)
from specem_core.errors import ContextWindowError, ModelNotFoundError
from specem_core.scoring import softmax
from specem_core.types import Candidate, CandidateScore, Draft

T = TypeVar("T")

DraftMode = Literal["auto", "completions", "chat_prefill", "chat_continue"]
VerifyMode = Literal["auto", "logprobs", "judge"]
ServerKind = Literal["vllm", "sglang", "llama-cpp-python", "llama.cpp", "openai", "generic"]
MaxTokensZero = Literal["zero", "unlimited", "rejected", "unknown"]


# -- server capabilities and probing --------------------------------------------------------
@dataclass(frozen=True)
class ServerCapabilities:
    """What a server was found to support (see :meth:`OpenAIHTTPMember.probe`)."""

    server: ServerKind = "generic"
    model: str | None = None
    context_window: int | None = None
    completions: bool = False
    chat: bool = False
    echo_logprobs: bool = False
    echo_shift: int | None = None
    """0: echo log-probs aligned; 1: shifted by one (corrected); None: not usable."""
    max_tokens_zero: MaxTokensZero = "unknown"
    chat_prefill: bool | None = None
    chat_logprobs: bool | None = None
    notes: tuple[str, ...] = ()


PROBE_QUESTION = "Count from 1 to 40, separated by commas."
PROBE_ANSWER = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"
"""A continuation every instruct model predicts token by token: echo log-probs whose top-1
prediction matches the *next* echoed token are shifted by one."""
PREFILL_ANSWER = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def _server_kind(models_body: Any) -> tuple[ServerKind, list[dict[str, Any]]]:
    data = models_body.get("data") if isinstance(models_body, dict) else None
    entries = [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []
    owners = {str(d.get("owned_by", "")).lower() for d in entries}
    kind: ServerKind = "generic"
    if "vllm" in owners:
        kind = "vllm"
    elif "sglang" in owners:
        kind = "sglang"
    elif "me" in owners:
        kind = "llama-cpp-python"
    elif "llamacpp" in owners:
        kind = "llama.cpp"
    elif owners & {"openai", "system", "openai-internal"}:
        kind = "openai"
    return kind, entries


def _context_from_models(entries: Sequence[Mapping[str, Any]], model: str | None) -> int | None:
    for d in entries:
        if model is not None and d.get("id") != model:
            continue
        for key in ("max_model_len", "context_length", "context_window", "n_ctx"):
            value = d.get(key) or (d.get("meta") or {}).get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


# -- the continue-prompt for chat APIs that cannot prefill ----------------------------------
CONTINUE_PROMPT = (
    "Your previous answer was cut off. Here is the part written so far, between <partial> tags:\n"
    "<partial>{partial}</partial>\n"
    "Continue it from exactly where it stops. Start your reply by repeating its last words "
    '"{anchor}" exactly, then go on with the rest of the answer. Do not restart the answer, do not '
    "add any comment, and do not use the tags."
)
"""Shown to chat models that cannot continue an assistant message (documented in the README).
The reply is spliced onto the answer at the repeated words (:func:`splice_continuation`)."""


def continuation_anchor(partial: str, words: int = 3, max_chars: int = 40) -> str:
    """The last few words of ``partial`` that the model is asked to repeat."""
    tail = partial[-max_chars:]
    parts = tail.rstrip().split(" ")
    anchor = " ".join(parts[-words:]) if len(parts) > words else tail.rstrip()
    return anchor.lstrip()


def splice_continuation(partial: str, reply: str, anchor: str) -> str:
    """The new text to append to ``partial``, from a reply that (ideally) starts with ``anchor``.

    1. The reply repeats the anchor near its start: everything after it.
    2. The reply starts with some other tail of the partial answer (>= 4 characters): the rest.
    3. Otherwise the reply is taken as is, with a space inserted between two words.
    """
    if not partial:
        return reply
    if anchor:
        idx = reply.find(anchor, 0, len(anchor) + 12)
        if idx != -1 and not reply[:idx].strip(" \"'`*.…"):
            rest = reply[idx + len(anchor) :]
            trailing = partial[len(partial.rstrip()) :]
            return rest.lstrip() if trailing and rest.startswith((" ", "\n")) else rest
    stripped = reply.lstrip()
    for n in range(min(len(partial), len(stripped)), 3, -1):
        if partial.endswith(stripped[:n]):
            return stripped[n:]
    if partial[-1:].isalnum() and stripped[:1].isalnum():
        return " " + stripped
    if partial[-1:] in ",.;:!?)" and stripped[:1].isalnum():
        return " " + stripped
    return stripped if partial[-1:].isspace() else reply


# -- chat-template helpers ------------------------------------------------------------------
class _JinjaTemplate(JinjaChatTemplate):
    """Renders a Jinja chat template without a tokenizer (for ``chat_template=`` alone); it stands
    in for a tokenizer that counts no tokens."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []


def load_tokenizer(spec: str | os.PathLike[str]) -> Any:
    """A Hugging Face tokenizer from a directory or a Hugging Face model id.

    The name of a packaged default model (``"smollm2"``) is not resolved here: the registry turns
    it into its converted directory first (:func:`specem_core.registry.resolve_tokenizer`, which
    :func:`specem_core.registry.load_member` applies to ``tokenizer=``).

    Raises:
        ModelNotFoundError: nothing loadable there.
    """
    text = str(spec)
    path = Path(text).expanduser()
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the [hf] extra is missing
        raise ModelNotFoundError("loading a tokenizer needs transformers: pip install 'specem[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        hint = ""
        if "/" not in text and os.sep not in text and not path.exists():
            hint = " (for a packaged model name, pass tokenizer=specem_core.registry.resolve_tokenizer(name))"
        reason = str(exc).splitlines()[0] if str(exc) else exc
        raise ModelNotFoundError(f"no tokenizer at {text!r}: {reason}{hint}") from exc


def _stop_token_ids(tokenizer: Any, end_of_turn: str | None) -> list[int]:
    """Ids of the end-of-turn / EOS tokens (for ``ignore_eos`` through ``logit_bias``), if known."""
    if tokenizer is None or isinstance(tokenizer, _JinjaTemplate):
        return []
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    if end_of_turn:
        with contextlib.suppress(Exception):
            value = tokenizer.convert_tokens_to_ids(end_of_turn)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


def _end_of_turn_token(chat: ChatFormat, tokenizer: Any) -> str | None:
    """The end-of-turn special token's text (e.g. ``<|im_end|>``), when the tokenizer knows it."""
    after = chat.end_of_turn_text()
    if not after or tokenizer is None or isinstance(tokenizer, _JinjaTemplate):
        return None
    try:
        ids = tokenizer.encode(after, add_special_tokens=False)
        specials = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
        if ids and int(ids[0]) in specials:
            return str(tokenizer.convert_ids_to_tokens(int(ids[0])))
    except Exception:
        return None
    return None


# -- the member -----------------------------------------------------------------------------
@dataclass
class MemberStats:
    """Counters of one member (all requests)."""

    drafts: int = 0
    scored_candidates: int = 0
    inexact_tokens: int = 0
    """Tokens of a shifted server's echo that were missing from the previous slot's top-k."""
    judge_calls: int = 0
    judge_abstentions: int = 0
    """Judge answers that put no mass on any label (the row became uniform)."""
    flagged_candidates: int = 0
    """Candidates whose text addressed the judge (they forfeit that judge's vote)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time per stage (draft / score)."""


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
        draft_mode: ``auto`` picks ``completions`` when a chat template is known locally, else
            ``chat_prefill`` when the server supports it, else ``chat_continue``, else plain-format
            completions.
        verify_mode: ``auto`` picks ``logprobs`` (exact, needs echo log-probs) and falls back to
            ``judge``; a member whose server supports neither stops verifying (logged).
        tokenizer: a tokenizer object, a tokenizer directory or a Hugging Face id: the source of
            the chat template (and of exact token counts). For a packaged model name
            (``"smollm2"``) pass :func:`specem_core.registry.resolve_tokenizer` of it, or build the
            member with ``load_member("openai:…", tokenizer="smollm2")``, which does that.
        chat_template: a Jinja template (overrides the tokenizer's).
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
    ) -> None:
        if draft_mode not in ("auto", "completions", "chat_prefill", "chat_continue"):
            raise ValueError(f"unknown draft_mode {draft_mode!r}")
        if verify_mode not in ("auto", "logprobs", "judge"):
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
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        if tokenizer is None and chat_template is not None:
            tokenizer = _JinjaTemplate(chat_template)
        self.tokenizer = tokenizer
        self.chat: ChatFormat | None = ChatFormat(tokenizer, chat_template) if tokenizer is not None else None
        if self.chat is not None and not self.chat.uses_template:
            self.chat = None if isinstance(tokenizer, _JinjaTemplate) else self.chat
        self.end_of_turn = end_of_turn or (_end_of_turn_token(self.chat, tokenizer) if self.chat else None)
        self.judge_options: JudgeOptions = judge if judge is not None else JudgeOptions()
        self._caps = capabilities
        self._kind: ServerKind = "generic"
        self._stop_ids = _stop_token_ids(tokenizer, self.end_of_turn)
        self._probe_lock = threading.Lock()
        self._resolved: tuple[DraftMode, VerifyMode | None] | None = None

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
    def capabilities(self) -> ServerCapabilities | None:
        """The probed (or given) capabilities; ``None`` before the first probe."""
        return self._caps

    def open(self, request: SessionRequest) -> OpenAIHTTPSession:
        """Probe the server once (first request), then start a session."""
        self.probe()
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
        assert self._resolved is not None
        return self._resolved

    def probe(self, *, force: bool = False) -> ServerCapabilities:
        """Find out what the server supports (once; thread-safe) and resolve the modes.

        Raises:
            HTTPMemberError: the server is unreachable.
            CapabilityError: an explicitly requested mode is not supported.
        """
        with self._probe_lock:
            if self._caps is None or force:
                self._caps = run_sync(self._aprobe())
                for note in self._caps.notes:
                    log.info("%s: %s", self.name, note)
            if self._resolved is None or force:
                self._resolved = self._resolve(self._caps)
            return self._caps

    def _resolve(self, caps: ServerCapabilities) -> tuple[DraftMode, VerifyMode | None]:
        if self.model is None and caps.model is not None:
            self.model = caps.model
        draft: DraftMode = self.draft_mode
        if draft == "auto":
            if caps.completions and self.chat is not None:
                draft = "completions"
            elif caps.chat_prefill:
                draft = "chat_prefill"
            elif caps.chat:
                draft = "chat_continue"
            elif caps.completions:
                draft = "completions"
            elif self.can_draft:
                raise CapabilityError(f"{self.name}: the server offers neither completions nor chat completions")
        elif self.can_draft:
            need = {
                "completions": caps.completions,
                "chat_prefill": bool(caps.chat_prefill),
                "chat_continue": caps.chat,
            }
            if not need[draft]:
                raise CapabilityError(f"{self.name}: draft_mode={draft!r} is not supported by the server")
        verify: VerifyMode | None = None
        if self.can_verify:
            exact = caps.completions and caps.echo_logprobs and caps.echo_shift is not None
            judge_ok = bool(caps.chat and caps.chat_logprobs)
            if self.verify_mode == "logprobs" and not exact:
                raise CapabilityError(f"{self.name}: verify_mode='logprobs' needs usable echo log-probs")
            if self.verify_mode == "judge" and not judge_ok:
                raise CapabilityError(f"{self.name}: verify_mode='judge' needs chat completions with logprobs")
            if self.verify_mode == "auto":
                verify = "logprobs" if exact else ("judge" if judge_ok else None)
                if verify is None:
                    log.warning("%s: the server exposes no log-probs; the member will not verify", self.name)
                    self.can_verify = False
            else:
                verify = self.verify_mode
        return draft, verify

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
    async def _aprobe(self) -> ServerCapabilities:
        client = self.client
        notes: list[str] = []
        kind: ServerKind = "generic"
        entries: list[dict[str, Any]] = []
        try:
            kind, entries = _server_kind(await client.request_json("GET", "/models", retries=1))
        except ServerResponseError:
            notes.append("/models answered with an unexpected body")
        except HTTPMemberError as exc:
            if _fatal(exc):  # unreachable, unauthorized, overloaded: nothing else will work either
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
        caps = ServerCapabilities(server=kind, model=model, context_window=_context_from_models(entries, model))
        caps = replace(caps, notes=tuple(notes))
        need_completions = self.draft_mode in ("auto", "completions") or self.verify_mode in ("auto", "logprobs")
        if need_completions:
            caps = await self._probe_echo(caps)
        need_chat = (
            not caps.completions
            or self.draft_mode in ("chat_prefill", "chat_continue")
            or (self.draft_mode == "auto" and self.chat is None and self.can_draft)
            or self.verify_mode == "judge"
            or (self.verify_mode == "auto" and caps.echo_shift is None and self.can_verify)
        )
        if need_chat:
            caps = await self._probe_chat(caps)
        return caps

    def _probe_text(self) -> tuple[str, str]:
        prompt = self.render_prompt([{"role": "user", "content": PROBE_QUESTION}], None)
        return prompt, prompt + PROBE_ANSWER

    async def _probe_echo(self, caps: ServerCapabilities) -> ServerCapabilities:
        notes = list(caps.notes)
        prompt, sent = self._probe_text()
        payload = self.body(prompt=sent, max_tokens=1, echo=True, logprobs=5, **self.greedy_body())
        try:
            answer = await self.client.request_json("POST", "/completions", payload, retries=1)
        except HTTPMemberError as exc:
            if _fatal(exc):
                raise
            notes.append(f"/completions with echo+logprobs rejected ({exc.status})")
            # maybe completions without echo still work
            try:
                body = self.body(prompt=sent, max_tokens=1, **self.greedy_body())
                _first_choice(await self.client.request_json("POST", "/completions", body, retries=1))
                return replace(caps, completions=True, notes=(*notes, "echo log-probs unavailable"))
            except HTTPMemberError:
                return replace(caps, notes=(*notes, "no /completions endpoint"))
        caps = replace(caps, completions=True)
        try:
            echo = parse_echo_logprobs(answer)
            shift = self._decide_shift(sent, len(prompt), echo)
        except (ServerResponseError, AlignmentError) as exc:
            notes.append(f"echo log-probs unusable: {exc}")
            return replace(caps, notes=tuple(notes))
        if shift is None:
            notes.append("echo log-probs: alignment could not be established; exact verification disabled")
        elif shift == 1:
            notes.append("echo log-probs are shifted by one position; corrected from the previous slot's top_logprobs")
        caps = replace(caps, echo_logprobs=True, echo_shift=shift, notes=tuple(notes))
        return replace(caps, max_tokens_zero=await self._probe_max_tokens_zero(sent))

    @staticmethod
    def _decide_shift(sent: str, prompt_len: int, echo: EchoLogprobs) -> int | None:
        alignment = align_echo(sent, echo, region_start=prompt_len, text_end=len(sent))
        idx = alignment.text_entries
        aligned = shifted = total = 0
        for n, j in enumerate(idx[:-1]):
            if n < 3:
                continue  # the first numbers are not predictable yet
            top = _top1(echo.top_logprobs[j])
            if top is None:
                continue
            total += 1
            aligned += top == echo.tokens[j]
            shifted += top == echo.tokens[idx[n + 1]]
        if total < 6:
            return None
        if aligned >= 0.6 * total and aligned >= 2 * shifted + 1:
            return 0
        if shifted >= 0.6 * total and shifted >= 2 * aligned + 1:
            return 1
        return None

    async def _probe_max_tokens_zero(self, sent: str) -> MaxTokensZero:
        """What ``max_tokens=0`` does in the request scoring sends (``echo`` + ``logprobs``):
        ``"zero"`` when the server echoes the prompt with its log-probs and generates nothing (vLLM's
        echo without generation), ``"unlimited"`` when it generates anyway (llama-cpp-python: 0 is
        no limit; the stop strings end it at once), ``"rejected"`` on a 4xx. Only ``"zero"`` makes
        scoring send 0; anything else sends 1 and ignores the generated token."""
        payload = self.body(
            prompt=sent, max_tokens=0, echo=True, logprobs=1, stop=[",", "\n", " ", "."], **self.greedy_body()
        )
        try:
            answer = await self.client.request_json("POST", "/completions", payload, timeout=20.0, retries=0)
        except HTTPMemberError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                return "rejected"
            return "unlimited" if exc.status is None else "unknown"
        try:
            echo = parse_echo_logprobs(answer)  # the prompt's log-probs, as scoring reads them
        except ServerResponseError:
            return "unknown"
        usage = answer.get("usage") if isinstance(answer, dict) else None
        generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
        # vLLM generates one token for an echo without generation, drops it and still counts it
        # (measured: completion_tokens 1, text and log-probs the prompt's only)
        drops_its_token = self._server() in ("vllm", "sglang")
        if echo.text == sent and (generated == 0 or drops_its_token):
            return "zero"
        return "unlimited"

    async def _probe_chat(self, caps: ServerCapabilities) -> ServerCapabilities:
        notes = list(caps.notes)
        msgs = [{"role": "user", "content": PROBE_QUESTION}]
        payload = self.body(messages=msgs, max_tokens=1, logprobs=True, top_logprobs=5, **self.greedy_body())
        chat = chat_logprobs = False
        try:
            answer = await self.client.request_json("POST", "/chat/completions", payload, retries=1)
            chat = True
            chat_logprobs = _chat_top_logprobs(answer) is not None
        except HTTPMemberError as exc:
            if _fatal(exc):
                raise
            try:  # logprobs may be what was rejected
                body = self.body(messages=msgs, max_tokens=1, **self.greedy_body())
                _first_choice(await self.client.request_json("POST", "/chat/completions", body, retries=1))
                chat = True
            except HTTPMemberError:
                notes.append("no /chat/completions endpoint")
        caps = replace(caps, chat=chat, chat_logprobs=chat_logprobs)
        if chat and (self.draft_mode == "chat_prefill" or (self.draft_mode == "auto" and self.chat is None)):
            caps = replace(caps, chat_prefill=await self._probe_prefill())
        return replace(caps, notes=tuple(notes))

    async def _probe_prefill(self) -> bool:
        msgs = [{"role": "user", "content": PROBE_QUESTION}, {"role": "assistant", "content": PREFILL_ANSWER}]
        payload = self.body(
            messages=msgs,
            max_tokens=4,
            continue_final_message=True,
            add_generation_prompt=False,
            **self.greedy_body(),
        )
        try:
            answer = await self.client.request_json("POST", "/chat/completions", payload, retries=1)
            content = _chat_content(answer)
        except HTTPMemberError:
            return False
        return content.lstrip().startswith("11")


def _fatal(exc: HTTPMemberError) -> bool:
    """Probe failures that say nothing about features: unreachable, auth, rate limit, server error."""
    return exc.status is None or exc.status >= 500 or exc.status in (401, 403, 407, 429)


def _default_name(base_url: str) -> str:
    parts = urlsplit(base_url)
    return parts.netloc or base_url


def _chat_content(body: Any) -> str:
    choice = _first_choice(body)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ServerResponseError("chat answer has no message")
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ServerResponseError("chat message content is not a string")
    return content


def _chat_top_logprobs(body: Any) -> list[tuple[str, float]] | None:
    """``(token, logprob)`` alternatives of the first generated token, or ``None``."""
    choice = _first_choice(body)
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    content = lp.get("content")
    if not isinstance(content, list) or not content or not isinstance(content[0], dict):
        return None
    first = content[0]
    out: list[tuple[str, float]] = []
    tops = first.get("top_logprobs")
    if not isinstance(tops, list):
        raise ServerResponseError("chat logprobs: top_logprobs is not a list")
    for item in tops:
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            raise ServerResponseError("chat logprobs: malformed top_logprobs entry")
        value = _num(item.get("logprob"))
        if value is not None:
            out.append((item["token"], value))
    token, value = first.get("token"), _num(first.get("logprob"))
    if isinstance(token, str) and value is not None and all(t != token for t, _ in out):
        out.append((token, value))
    return out


# -- the judge verify mode ------------------------------------------------------------------
async def judge_scores(
    member: OpenAIHTTPMember,
    messages: Sequence[Mapping[str, Any]],
    committed: str,
    candidates: Sequence[Candidate],
    score_eos: bool,
    round_index: int,
) -> list[CandidateScore]:
    """One judge row over ``candidates`` (see :mod:`specem_core.backends.http.judge_prompt`)."""
    n = len(candidates)
    if n == 1:
        return [CandidateScore(mean_logprob=0.0, probability=1.0)]
    if n > len(LABELS):
        raise HTTPMemberError(f"a judge can compare at most {len(LABELS)} candidates, got {n}")
    options = member.judge_options
    seed = None if options.seed is None else options.seed + round_index
    orders = judge_orders(n, options.permutations, random.Random(seed))
    nonce = _nonce([committed, *(c.text for c in candidates)])

    async def ask(order: list[int]) -> list[float] | None:
        shown = [(candidates[i].text, candidates[i].ended and score_eos) for i in order]
        payload = member.body(
            messages=judge_messages(messages, committed, shown, nonce=nonce, options=options),
            max_tokens=1,
            logprobs=True,
            top_logprobs=options.top_logprobs,
            **member.greedy_body(),
        )
        answer = await member.client.post("/chat/completions", payload)
        alternatives = _chat_top_logprobs(answer)
        if alternatives is None:
            raise ServerResponseError("the judge's answer carries no logprobs")
        member.stats.judge_calls += 1
        probs = label_probabilities(alternatives, n)
        if probs is None:
            member.stats.judge_abstentions += 1
            log.info("%s: judge answer put no mass on any label; abstaining for this order", member.name)
            return None
        by_candidate = [0.0] * n
        for label_index, cand_index in enumerate(order):
            by_candidate[cand_index] = probs[label_index]
        return by_candidate

    rows = [r for r in await _gather([ask(o) for o in orders]) if r is not None]
    avg = [sum(r[i] for r in rows) / len(rows) for i in range(n)] if rows else [1.0 / n] * n
    if options.flag_injections:
        flagged = [addresses_judge(c.text) for c in candidates]
        if any(flagged) and not all(flagged):
            member.stats.flagged_candidates += sum(flagged)
            log.info("%s: %d candidate(s) addressed the judge and forfeit its vote", member.name, sum(flagged))
            avg = [0.0 if f else p for p, f in zip(avg, flagged, strict=True)]
    total = sum(avg)
    probs = [p / total for p in avg] if total > 0 else [1.0 / n] * n
    return [CandidateScore(mean_logprob=math.log(max(p, 1e-12)), probability=p) for p in probs]


# -- the session ----------------------------------------------------------------------------
class OpenAIHTTPSession(MemberSession):
    """One request's state: the prompt, the committed text, the in-flight requests."""

    def __init__(self, member: OpenAIHTTPMember, request: SessionRequest) -> None:
        self._m = member
        self._request = request
        draft_mode, verify_mode = member.modes
        self.draft_mode = draft_mode
        self.verify_mode = verify_mode
        self._messages = [dict(m) for m in request.messages]
        self._tools = list(request.tools) if request.tools else None
        self._prompt = member.render_prompt(self._messages, self._tools)
        self._text = ""
        self._seed = request.seed
        self._round = 0
        self._inflight = Inflight()
        self._closed = False
        self._offset_shift: int | None = None
        self._chars_per_token = 4.0
        self._drafted_chars = 0
        self._drafted_tokens = 0
        tok = member.tokenizer
        self._exact_counts = tok is not None and not isinstance(tok, _JinjaTemplate) and member.chat is not None
        self._prompt_tokens = self._count(self._prompt) if self._exact_counts else self._estimate(self._prompt)
        self._completion_tokens = 0
        window = member.context_window
        if window and self._prompt_tokens + 2 > window:
            raise ContextWindowError(
                f"the prompt is about {self._prompt_tokens} tokens for member {member.name!r}, "
                f"whose context window is {window}"
            )

    # -- token accounting -------------------------------------------------------------------
    def _count(self, text: str) -> int:
        return len(self._m.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _estimate(self, text: str) -> int:
        return math.ceil(len(text) / self._chars_per_token) if text else 0

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in this member's tokens (exact with a local tokenizer, else reported by
        the server after the first draft, else estimated)."""
        return self._prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """Committed response length in this member's tokens (exact with a local tokenizer)."""
        return self._completion_tokens

    # -- protocol ---------------------------------------------------------------------------
    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        """Continue ``prompt + committed`` by up to ``max_tokens`` tokens (one HTTP request; the
        server drafts on its own, so ``hints`` are not used)."""
        return self._sync(self.adraft_core(max_tokens, sampling))

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Score every candidate (concurrent requests): exact log-probs, or the judge."""
        return self._sync(self.ascore_core(candidates, score_eos=score_eos))

    def commit(self, text: str, *, final: bool = False) -> None:
        """Append the winner to the committed text (no request: servers are stateless)."""
        self._text += text
        if self._exact_counts:
            self._completion_tokens = self._count(self._text)
        else:
            self._completion_tokens = self._estimate(self._text)

    def close(self) -> None:
        """Cancel whatever is still in flight."""
        self._closed = True
        self.cancel()

    def cancel(self) -> None:
        """Cancel the in-flight requests of this session (their callers get :class:`RequestCancelledError`)."""
        self._inflight.cancel()

    async def adraft(self, max_tokens: int, sampling: SamplingParams) -> Draft:
        """Async :meth:`draft` (from any event loop)."""
        return await run_async(self._open(self.adraft_core(max_tokens, sampling)), track=self._inflight)

    async def ascore(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Async :meth:`score` (from any event loop)."""
        return await run_async(self._open(self.ascore_core(candidates, score_eos=score_eos)), track=self._inflight)

    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        return run_sync(self._open(coro), track=self._inflight)

    def _open(self, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coro``, refused when the session is closed: a closed session sends no request, from
        the sync calls and the async ones alike."""
        if self._closed:
            coro.close()
            raise RequestCancelledError("the session is closed")
        return coro

    # -- drafting ---------------------------------------------------------------------------
    async def adraft_core(self, max_tokens: int, sampling: SamplingParams) -> Draft:
        """Drafting on the background loop."""
        started = time.perf_counter()
        self._round += 1
        m = self._m
        seed = None if self._seed is None else self._seed + self._round
        params = m.sampling_body(sampling, seed)
        if self.draft_mode == "completions":
            stops = list(PLAIN_TURN_STOPS) if m.chat is None else ([m.end_of_turn] if m.end_of_turn else [])
            payload = m.body(prompt=self._prompt + self._text, max_tokens=max_tokens, **params)
            if stops:
                payload["stop"] = stops
            answer = await m.client.post("/completions", payload)
            choice = _first_choice(answer)
            text = choice.get("text")
            if not isinstance(text, str):
                raise ServerResponseError("completion has no text")
        elif self.draft_mode == "chat_prefill":
            msgs = self._m.chat_messages(self._messages, self._tools)
            extra: dict[str, Any] = {}
            if self._text:
                msgs.append({"role": "assistant", "content": self._text})
                extra = {"continue_final_message": True, "add_generation_prompt": False}
            payload = m.body(messages=msgs, max_tokens=max_tokens, **params, **extra)
            answer = await m.client.post("/chat/completions", payload)
            choice = _first_choice(answer)
            text = _chat_content(answer)
        else:
            msgs = self._m.chat_messages(self._messages, self._tools)
            anchor = ""
            budget = max_tokens
            if self._text:
                anchor = continuation_anchor(self._text)
                msgs.append({"role": "assistant", "content": self._text})
                msgs.append({"role": "user", "content": CONTINUE_PROMPT.format(partial=self._text, anchor=anchor)})
                budget = max_tokens + max(2, len(anchor) // 3 + 2)
            answer = await m.client.post("/chat/completions", m.body(messages=msgs, max_tokens=budget, **params))
            choice = _first_choice(answer)
            text = splice_continuation(self._text, _chat_content(answer), anchor)
        finish = choice.get("finish_reason")
        ended = finish == "stop"
        text = text.rstrip("\ufffd")
        usage = answer.get("usage") if isinstance(answer, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(tokens, int) or tokens < 0:
            tokens = max(1, self._estimate(text)) if text else 0
        if self.draft_mode == "completions" and not self._text and isinstance(usage, dict) and not self._exact_counts:
            prompt_tokens = usage.get("prompt_tokens")
            if isinstance(prompt_tokens, int) and prompt_tokens > 0:
                self._prompt_tokens = prompt_tokens
        if text and tokens:
            self._drafted_chars += len(text)
            self._drafted_tokens += tokens
            self._chars_per_token = max(1.0, self._drafted_chars / self._drafted_tokens)
        m.stats.drafts += 1
        m.stats.seconds["draft"] = m.stats.seconds.get("draft", 0.0) + time.perf_counter() - started
        return Draft(text=text, ended=ended, tokens=tokens)

    # -- verification -----------------------------------------------------------------------
    async def ascore_core(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        """Scoring on the background loop."""
        started = time.perf_counter()
        try:
            if not candidates:
                return []
            if self.verify_mode == "judge":
                return await judge_scores(self._m, self._messages, self._text, candidates, score_eos, self._round)
            if self.verify_mode != "logprobs":
                raise CapabilityError(f"{self._m.name} cannot verify")
            scored = await _gather([self._score_one(c, score_eos) for c in candidates])
            known = [s[0] for s in scored if s is not None]
            neutral = sum(known) / len(known) if known else 0.0
            means = [(s[0], s[1]) if s is not None else (neutral, 0) for s in scored]
            probs = softmax([mean for mean, _ in means])
            self._m.stats.scored_candidates += len(candidates)
            return [
                CandidateScore(mean_logit=None, mean_logprob=mean, n_tokens=n, probability=p)
                for (mean, n), p in zip(means, probs, strict=True)
            ]
        finally:
            stats = self._m.stats.seconds
            stats["score"] = stats.get("score", 0.0) + time.perf_counter() - started

    async def _score_one(self, cand: Candidate, score_eos: bool) -> tuple[float, int] | None:
        """Mean log-prob and token count of one candidate; ``None`` when there is nothing to score
        (an empty finished candidate and no known end-of-turn token): it gets the row's mean."""
        m = self._m
        caps = m.capabilities
        assert caps is not None
        assert caps.echo_shift is not None
        base = self._prompt + self._text
        with_eos = cand.ended and (score_eos or not cand.text) and m.end_of_turn is not None
        if not cand.text and not with_eos:
            return None
        sent = base + cand.text + (m.end_of_turn or "" if with_eos else "")
        text_end = len(base) + len(cand.text)
        max_tokens = 0 if caps.max_tokens_zero == "zero" else 1
        k = max(1, m.top_logprobs if caps.echo_shift == 1 else 1)
        payload = m.body(prompt=sent, max_tokens=max_tokens, echo=True, logprobs=k, **m.greedy_body())
        echo = parse_echo_logprobs(await m.client.post("/completions", payload))
        if not echo.text.startswith(sent):
            raise AlignmentError("the echoed text differs from the prompt that was sent")
        # Validate from the start of the answer (for an empty answer: the prompt's last character).
        region_start = min(len(self._prompt), max(0, text_end - 1))
        alignment = align_echo(
            sent,
            echo,
            region_start=region_start,
            text_end=text_end,
            eot_text=m.end_of_turn if with_eos else None,
            max_generated=max_tokens,
            known_shift=self._offset_shift,
        )
        self._offset_shift = alignment.offset_shift
        span = span_logprobs(
            echo,
            alignment,
            span_start=len(base),
            span_end=text_end,
            with_eos=with_eos,
            eot_text=m.end_of_turn,
            shift=caps.echo_shift,
        )
        self._check_greedy(echo, alignment, sent, caps.echo_shift, with_eos)
        if span.missing:
            if m.strict_scoring:
                raise AlignmentError(f"{span.missing} token(s) missing from the server's top_logprobs")
            m.stats.inexact_tokens += span.missing
            log.warning(
                "%s: %d token(s) not in the previous slot's top-%d; scored with that slot's lowest listed log-prob",
                m.name,
                span.missing,
                k,
            )
        if span.eos_unknown:
            if m.strict_scoring:
                raise AlignmentError("the end-of-turn log-prob is unknown on this (shifted) server")
            m.stats.inexact_tokens += 1
            log.warning("%s: end-of-turn log-prob unknown on a shifted server; scored the text only", m.name)
        if not span.logprobs:
            return None
        return sum(span.logprobs) / len(span.logprobs), len(span.logprobs)

    def _check_greedy(
        self, echo: EchoLogprobs, alignment: EchoAlignment, sent: str, shift: int, with_eos: bool
    ) -> None:
        """The server's own greedy token must be the top-1 of the slot the probe says predicts it."""
        generated = echo.text[len(sent) :]
        if not generated or not alignment.text_entries:
            return
        last_prompt = alignment.next_entry if with_eos else alignment.text_entries[-1]
        if last_prompt is None:
            return
        if shift == 0:
            slot = last_prompt + 1
            if slot >= len(echo.tokens):  # an aligned echo lists the generated token after the prompt
                raise AlignmentError(
                    "the echo does not list the generated token: the server pairs tokens and log-probs "
                    "differently than the probe found"
                )
            if echo.tokens[slot] != generated:
                return
            expected = echo.tokens[slot]
        else:
            slot = last_prompt
            expected = generated
        top = echo.top_logprobs[slot]
        predicted = _top1(top)
        if predicted is not None and predicted != expected and not _near_tie(top):
            raise AlignmentError(
                f"the server's greedy token {expected!r} is not the top-1 ({predicted!r}) of the slot that "
                "the probed alignment says predicts it; the echo alignment changed"
            )
