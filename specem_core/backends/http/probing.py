"""The probe's requests (the asking; :mod:`~specem_core.backends.http.probe` holds what they decide).

They ask what a server supports the way drafting and scoring will ask.

:meth:`OpenAIHTTPMember.probe <specem_core.backends.http.member.OpenAIHTTPMember.probe>` reads
``/v1/models`` and runs these on the member's own prompt format; what they find is a
:class:`~specem_core.backends.http.probe.ServerCapabilities` (its fields and the scoring paths are
described in :mod:`specem_core.backends.http.probe`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from specem_core.backends.http.alignment import parse_echo_logprobs
from specem_core.backends.http.errors import AlignmentError, CapabilityError, HTTPMemberError, ServerResponseError
from specem_core.backends.http.interface import ServerMember
from specem_core.backends.http.probe import (
    PREFILL_ANSWER,
    PROBE_ANSWER,
    PROBE_QUESTION,
    PROBE_SCORED,
    SHORT_ECHO,
    MaxTokensZero,
    ScorePath,
    ServerCapabilities,
    ServerKind,
    decide_shift,
    decide_shift_by_values,
    is_fatal,
    root_url,
)
from specem_core.backends.http.probe_cache import VERSION_ENDPOINTS, version_of
from specem_core.backends.http.responses import chat_content, chat_top_logprobs, first_choice
from specem_core.backends.http.token_scoring import SPECIAL_TEXT, TokenScorer, token_list


async def server_version(member: ServerMember, kind: ServerKind) -> str | None:
    """The server software's version, for the probe cache's key (``None`` where it does not say)."""
    endpoint = VERSION_ENDPOINTS.get(kind)
    if endpoint is None:
        return None
    try:
        body = await member.client.request_json("GET", f"{root_url(member.base_url)}{endpoint[0]}", retries=0)
    except (HTTPMemberError, ServerResponseError):
        return None
    return version_of(kind, body)


async def probe_drafting(member: ServerMember, caps: ServerCapabilities, can_draft: bool) -> ServerCapabilities:
    """What drafting needs, after ``/v1/models``: the server's tokenizer endpoint (and whether it
    renders a conversation), completions, and chat completions where drafting may use them."""
    if caps.server in ("vllm", "llama-cpp-python", "llama.cpp"):
        caps = await probe_tokenizer(member, caps, caps.server)
    if member.draft_mode in ("auto", "completions"):
        caps = await probe_completions(member, caps)
    exact_prompt = member.prompt_source_for(caps) != "plain"
    need_chat = (
        not caps.completions
        or member.draft_mode in ("chat_prefill", "chat_continue")
        or (member.draft_mode == "auto" and not exact_prompt and can_draft)
    )
    return await probe_chat(member, caps) if need_chat else caps


async def probe_scoring(member: ServerMember, caps: ServerCapabilities) -> ServerCapabilities:
    """How the server scores, each asked only where the member's ``verify_mode`` may use it, with
    requests of a few tokens: its exact scoring paths, fastest first (``score_paths``), echo
    log-probs, and chat log-probs where the member may verify as a judge."""
    mode = member.verify_mode
    if mode != "judge":
        vllm_paths = ("auto", "logprobs", "prompt_tail", "next_token")
        if caps.completions and caps.tokenize == "vllm" and mode in vllm_paths:
            caps = await probe_next_token(member, caps)
        if caps.next_token_logprobs and mode in ("auto", "logprobs", "prompt_tail"):
            caps = await probe_prompt_tail(member, caps)
        forced: list[float] = []
        grammars = ("llama-cpp-python", "llama.cpp")
        if caps.completions and caps.tokenize in grammars and mode in ("auto", "logprobs", "forced"):
            caps, forced = await probe_forced(member, caps)
        if caps.tokenize == "llama.cpp":
            pass  # llama-server has no echo; its forced path scores an end of turn itself
        elif forced:  # a few words echoed and compared with the forced values
            caps = await probe_short_echo(member, caps, forced)
        elif caps.completions or member.draft_mode in ("auto", "completions"):
            caps = await probe_echo(member, caps)
    paths: list[ScorePath] = []
    if caps.prompt_tail:
        paths.append("prompt_tail")
    if caps.next_token_logprobs:
        paths.append("next_token")
    if caps.token_grammar:
        paths.append("forced")
    if caps.completions and caps.echo_logprobs and caps.echo_shift is not None:
        paths.append("echo")
    caps = replace(caps, score_paths=tuple(paths))
    judge = mode == "judge" or (mode == "auto" and not caps.score_paths)
    if judge and caps.chat_logprobs is None:
        caps = await probe_chat(member, caps)
    return caps


async def probe_tokenizer(member: ServerMember, caps: ServerCapabilities, kind: ServerKind) -> ServerCapabilities:
    """The server's tokenizer endpoint, and whether it renders a conversation (vLLM, llama-server)."""
    root = root_url(member.base_url)
    model = {"model": member.model} if member.model is not None else {}
    try:
        if kind == "vllm":
            text = {**model, "prompt": "Hi"}
            token_list(await member.client.request_json("POST", f"{root}/tokenize", text, retries=1))
            caps = replace(caps, tokenize="vllm")
            question = [{"role": "user", "content": PROBE_QUESTION}]
            msgs = {**model, "messages": question, "add_generation_prompt": True}
            token_list(await member.client.request_json("POST", f"{root}/tokenize", msgs, retries=1))
            return replace(caps, renders_messages=True)
        if kind == "llama.cpp":  # llama-server: /tokenize, and /apply-template renders a conversation
            token_list(await member.client.request_json("POST", f"{root}/tokenize", {"content": "Hi"}, retries=1))
            caps = replace(caps, tokenize="llama.cpp")
            conversation: dict[str, Any] = {"messages": [{"role": "user", "content": PROBE_QUESTION}]}
            rendered = await member.client.request_json("POST", f"{root}/apply-template", conversation, retries=1)
            return replace(
                caps, renders_messages=isinstance(rendered, dict) and isinstance(rendered.get("prompt"), str)
            )
        token_list(await member.client.request_json("POST", f"{root}/extras/tokenize", {"input": "Hi"}, retries=1))
        return replace(caps, tokenize="llama-cpp-python")
    except HTTPMemberError as exc:
        if unreachable(exc):
            raise
        return replace(caps, notes=(*caps.notes, f"tokenizer endpoint unavailable ({exc.status})"))


async def probe_next_token(member: ServerMember, caps: ServerCapabilities) -> ServerCapabilities:
    """vLLM: the log-prob of a named next token after a token-id prompt (``logprob_token_ids``),
    tried on the probe's answer the way scoring asks for it."""
    scorer, failed = await _score_probe_answer(
        member, "next_token", member.chat is None, "next-token log-probs", "nothing to score in the probe"
    )
    if scorer is None:
        return replace(caps, notes=(*caps.notes, failed))
    reported = scorer.counts.cached_tokens is not None
    notes = list(caps.notes)
    if not reported:
        notes.append(
            "the server does not report cached prompt tokens (vLLM: --enable-prompt-tokens-details); "
            "verification assumes its prefix cache is on"
        )
    return replace(caps, next_token_logprobs=True, reports_cached_tokens=reported, notes=tuple(notes))


def check_model_served(
    name: str, model: str | None, entries: list[dict[str, Any]], caps: ServerCapabilities, can_draft: bool
) -> None:
    """Raise when drafting found no endpoint and ``model`` is not among what ``/v1/models`` lists:
    vLLM and SGLang answer 404 for a model they do not serve, so say that, not "no endpoint"."""
    listed = [str(e["id"]) for e in entries if e.get("id") is not None]
    if can_draft and model and listed and model not in listed and not (caps.completions or caps.chat):
        served = ", ".join(repr(i) for i in listed)
        raise CapabilityError(f"{name}: the server serves no model {model!r} (/v1/models lists {served})")


async def probe_prompt_tail(member: ServerMember, caps: ServerCapabilities) -> ServerCapabilities:
    """vLLM: prompt log-probs that read the prefix cache on the token-in-token-out endpoint
    (``/inference/v1/generate``, served with ``--enable-scale-out``); tried on the probe's answer the
    way scoring asks for it. Without the flag vLLM answers 403 (404 before it had the endpoint)."""
    if not caps.reports_cached_tokens:  # the answer must say which positions it computed
        return caps
    for _ in range(PROMPT_TAIL_PROBE_TRIES):
        scorer, failed = await _score_probe_answer(
            member, "prompt_tail", member.chat is None, "cached prompt log-probs", "nothing to score in the probe"
        )
        if scorer is None:
            return replace(caps, notes=(*caps.notes, failed))
        if not scorer.counts.tail_fallbacks:
            return replace(caps, prompt_tail=True)
    # scored, but not by the endpoint: it answered 400 every time
    refused = f"cached prompt log-probs: the endpoint refused the probe (400, {PROMPT_TAIL_PROBE_TRIES} tries)"
    return replace(caps, notes=(*caps.notes, refused))


PROMPT_TAIL_PROBE_TRIES = 3
"""vLLM 0.32 answers some prompt_tail requests with HTTP 400 by luck (a NaN in a cached position's
unwritten log-prob; 3 of 10 candidates in a test run), so one refusal does not decide the path."""


async def probe_forced(member: ServerMember, caps: ServerCapabilities) -> tuple[ServerCapabilities, list[float]]:
    """llama.cpp: a grammar of token ids forces exactly those tokens, each listed with its
    log-prob; tried on a few words (:data:`~specem_core.backends.http.probe.SHORT_ECHO`) the way
    scoring asks for it. Returns the capabilities and the forced words' log-probs (empty when the
    server cannot force them), which decide the echo's alignment next (:func:`probe_short_echo`)."""
    base, text = short_echo_text(member)
    scorer = TokenScorer(member, "forced", True, count_in_member=False)
    try:
        values = await scorer.token_logprobs(base, text)
    except HTTPMemberError as exc:
        if unreachable(exc):
            raise
        return replace(caps, notes=(*caps.notes, f"forced scoring unavailable: {exc}")), []
    if not values:
        return replace(caps, notes=(*caps.notes, "forced scoring: the probe's words could not be forced")), []
    return replace(caps, token_grammar=True), values


def short_echo_text(member: ServerMember) -> tuple[str, str]:
    """The forced probe's text and the words it scores: they start as the member's prompts start
    (a leading special token's text, such as a BOS a template writes), which decides whether a
    llama-cpp-python echo is aligned."""
    prompt = member.render_prompt([{"role": "user", "content": PROBE_QUESTION}], None)
    lead = SPECIAL_TEXT.match(prompt)
    return (lead.group(0) if lead else "") + SHORT_ECHO[0], SHORT_ECHO[1]


async def probe_short_echo(member: ServerMember, caps: ServerCapabilities, forced: list[float]) -> ServerCapabilities:
    """Echo log-probs where the server forces tokens: the forced probe's words echoed, aligned or
    shifted as their values say (:func:`~specem_core.backends.http.probe.decide_shift_by_values`):
    a few listed positions instead of a long echo (each costs a sort of the vocabulary on
    llama-cpp-python)."""
    base, text = short_echo_text(member)
    sent = base + text
    payload = member.body(prompt=sent, max_tokens=1, echo=True, logprobs=5, **member.greedy_body())
    try:
        answer = await member.client.request_json("POST", "/completions", payload, retries=1)
        echo = parse_echo_logprobs(answer)
    except HTTPMemberError as exc:
        if is_fatal(exc):
            raise
        return replace(caps, notes=(*caps.notes, f"/completions with echo+logprobs rejected ({exc.status})"))
    except (ServerResponseError, AlignmentError) as exc:
        return replace(caps, notes=(*caps.notes, f"echo log-probs unusable: {exc}"))
    try:
        shift = decide_shift_by_values(sent, len(base), echo, forced)
    except AlignmentError as exc:
        return replace(caps, notes=(*caps.notes, f"echo log-probs unusable: {exc}"))
    return await _with_echo(member, caps, shift, list(caps.notes))


async def _score_probe_answer(
    member: ServerMember, path: ScorePath, add_special_tokens: bool, label: str, nothing_scored: str
) -> tuple[TokenScorer | None, str]:
    """Score the probe's answer on ``path`` as verification will: the scorer when it scored, else
    ``None`` and the note saying why (``label``: the path's name in it). An unreachable server
    raises; any other error only means the server lacks the path."""
    prompt, _ = probe_text(member)
    scorer = TokenScorer(member, path, add_special_tokens=add_special_tokens, count_in_member=False)
    try:
        scored = await scorer.score(prompt, PROBE_SCORED, None)
    except HTTPMemberError as exc:
        if path == "prompt_tail" and exc.status in (403, 404, 405):
            return None, f"{label} unavailable ({exc.status}): serve vLLM with --enable-scale-out for them"
        if unreachable(exc):
            raise
        return None, f"{label} unavailable: {exc}"
    if scored is None:
        return None, f"{label}: {nothing_scored}"
    return scorer, ""


def probe_text(member: ServerMember) -> tuple[str, str]:
    prompt = member.render_prompt([{"role": "user", "content": PROBE_QUESTION}], None)
    return prompt, prompt + PROBE_ANSWER


async def probe_completions(member: ServerMember, caps: ServerCapabilities) -> ServerCapabilities:
    """Whether ``/v1/completions`` answers (what drafting on it needs): one token after a few words."""
    body = member.body(prompt=SHORT_ECHO[0], max_tokens=1, **member.greedy_body())
    try:
        first_choice(await member.client.request_json("POST", "/completions", body, retries=1))
    except HTTPMemberError as exc:
        if is_fatal(exc):
            raise
        return replace(caps, notes=(*caps.notes, f"no /completions endpoint ({exc.status})"))
    except ServerResponseError as exc:
        return replace(caps, notes=(*caps.notes, f"/completions answered without a choice ({exc})"))
    return replace(caps, completions=True)


async def probe_echo(member: ServerMember, caps: ServerCapabilities) -> ServerCapabilities:
    """Echo log-probs on the probe's counting answer, aligned or shifted as its predictions say
    (:func:`~specem_core.backends.http.probe.decide_shift`): where the server offers no forced
    path to compare with (:func:`probe_short_echo`)."""
    notes = list(caps.notes)
    prompt, sent = probe_text(member)
    payload = member.body(prompt=sent, max_tokens=1, echo=True, logprobs=5, **member.greedy_body())
    try:
        answer = await member.client.request_json("POST", "/completions", payload, retries=1)
    except HTTPMemberError as exc:
        if is_fatal(exc):
            raise
        notes.append(f"/completions with echo+logprobs rejected ({exc.status})")
        # maybe completions without echo still work
        try:
            body = member.body(prompt=sent, max_tokens=1, **member.greedy_body())
            first_choice(await member.client.request_json("POST", "/completions", body, retries=1))
            return replace(caps, completions=True, notes=(*notes, "echo log-probs unavailable"))
        except HTTPMemberError:
            return replace(caps, notes=(*notes, "no /completions endpoint"))
    caps = replace(caps, completions=True)
    try:
        echo = parse_echo_logprobs(answer)
        shift = decide_shift(sent, len(prompt), echo)
    except (ServerResponseError, AlignmentError) as exc:
        notes.append(f"echo log-probs unusable: {exc}")
        return replace(caps, notes=tuple(notes))
    return await _with_echo(member, caps, shift, notes)


async def _with_echo(
    member: ServerMember, caps: ServerCapabilities, shift: int | None, notes: list[str]
) -> ServerCapabilities:
    """``caps`` with echo log-probs (aligned, shifted or unusable) and what ``max_tokens=0`` does."""
    if shift is None:
        notes.append("echo log-probs: alignment could not be established; exact verification disabled")
    elif shift == 1:
        notes.append("echo log-probs are shifted by one position; corrected from the previous slot's top_logprobs")
    caps = replace(caps, completions=True, echo_logprobs=True, echo_shift=shift, notes=tuple(notes))
    return replace(caps, max_tokens_zero=await probe_max_tokens_zero(member, SHORT_ECHO[0], caps.server))


async def probe_max_tokens_zero(member: ServerMember, sent: str, kind: ServerKind) -> MaxTokensZero:
    """What ``max_tokens=0`` does in the request scoring sends (``echo`` + ``logprobs``):
    ``"zero"`` when the server echoes the prompt with its log-probs and generates nothing (vLLM's
    echo without generation), ``"unlimited"`` when it generates anyway (llama-cpp-python: 0 is
    no limit; the stop strings end it at once), ``"rejected"`` on a 4xx. Only ``"zero"`` makes
    scoring send 0; anything else sends 1 and ignores the generated token."""
    payload = member.body(
        prompt=sent, max_tokens=0, echo=True, logprobs=1, stop=[",", "\n", " ", "."], **member.greedy_body()
    )
    try:
        answer = await member.client.request_json("POST", "/completions", payload, timeout=20.0, retries=0)
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
    drops_its_token = kind in ("vllm", "sglang")
    if echo.text == sent and (generated == 0 or drops_its_token):
        return "zero"
    return "unlimited"


async def probe_chat(member: ServerMember, caps: ServerCapabilities) -> ServerCapabilities:
    notes = list(caps.notes)
    msgs = [{"role": "user", "content": PROBE_QUESTION}]
    payload = member.body(messages=msgs, max_tokens=1, logprobs=True, top_logprobs=5, **member.greedy_body())
    chat = chat_logprobs = False
    try:
        answer = await member.client.request_json("POST", "/chat/completions", payload, retries=1)
        chat = True
        chat_logprobs = chat_top_logprobs(answer) is not None
    except HTTPMemberError as exc:
        if is_fatal(exc):
            raise
        try:  # logprobs may be what was rejected
            body = member.body(messages=msgs, max_tokens=1, **member.greedy_body())
            first_choice(await member.client.request_json("POST", "/chat/completions", body, retries=1))
            chat = True
        except HTTPMemberError:
            notes.append("no /chat/completions endpoint")
    caps = replace(caps, chat=chat, chat_logprobs=chat_logprobs)
    if chat and (member.draft_mode == "chat_prefill" or (member.draft_mode == "auto" and member.chat is None)):
        caps = replace(caps, chat_prefill=await probe_prefill(member))
    return replace(caps, notes=tuple(notes))


async def probe_prefill(member: ServerMember) -> bool:
    msgs = [{"role": "user", "content": PROBE_QUESTION}, {"role": "assistant", "content": PREFILL_ANSWER}]
    payload = member.body(
        messages=msgs,
        max_tokens=4,
        continue_final_message=True,
        add_generation_prompt=False,
        **member.greedy_body(),
    )
    try:
        answer = await member.client.request_json("POST", "/chat/completions", payload, retries=1)
        content = chat_content(answer)
    except HTTPMemberError:
        return False
    return content.lstrip().startswith("11")


def unreachable(exc: HTTPMemberError) -> bool:
    """Probe failures of an optional feature that still end the probe: no answer, or no access (any
    other error only means the server lacks the feature)."""
    return exc.status is None or exc.status in (401, 403, 407)
