"""Probing a server: what it supports, decided from a few requests before the first draft.

:class:`ServerCapabilities` is what :meth:`~specem_core.backends.http.member.OpenAIHTTPMember.probe`
finds: the server software (from ``/v1/models``), echo log-probs and whether they are shifted by
one position (:func:`decide_shift` on the echo of :data:`PROBE_ANSWER`), what ``max_tokens=0``
means, assistant prefill and chat log-probs. The member resolves its draft and verify modes
(:data:`DraftMode`, :data:`VerifyMode`) from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from specem_core.backends.http.alignment import EchoLogprobs, align_echo, top_token
from specem_core.backends.http.errors import HTTPMemberError

DraftMode = Literal["auto", "completions", "chat_prefill", "chat_continue"]
VerifyMode = Literal["auto", "logprobs", "judge"]
ServerKind = Literal["vllm", "sglang", "llama-cpp-python", "llama.cpp", "openai", "generic"]
MaxTokensZero = Literal["zero", "unlimited", "rejected", "unknown"]


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


def server_kind(models_body: Any) -> tuple[ServerKind, list[dict[str, Any]]]:
    """The server software, from the owners ``/v1/models`` lists, and the listed entries."""
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


def context_from_models(entries: Sequence[Mapping[str, Any]], model: str | None) -> int | None:
    """The context window ``/v1/models`` reports for ``model`` (any entry when ``None``)."""
    for d in entries:
        if model is not None and d.get("id") != model:
            continue
        for key in ("max_model_len", "context_length", "context_window", "n_ctx"):
            value = d.get(key) or (d.get("meta") or {}).get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def decide_shift(sent: str, prompt_len: int, echo: EchoLogprobs) -> int | None:
    """From the echo of the probe (``sent`` = prompt + :data:`PROBE_ANSWER`): 0 when each token's
    log-prob slot predicts that token, 1 when it predicts the next one, ``None`` when neither is clear."""
    alignment = align_echo(sent, echo, region_start=prompt_len, text_end=len(sent))
    idx = alignment.text_entries
    aligned = shifted = total = 0
    for n, j in enumerate(idx[:-1]):
        if n < 3:
            continue  # the first numbers are not predictable yet
        top = top_token(echo.top_logprobs[j])
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


def is_fatal(exc: HTTPMemberError) -> bool:
    """Probe failures that say nothing about features: unreachable, auth, rate limit, server error."""
    return exc.status is None or exc.status >= 500 or exc.status in (401, 403, 407, 429)
