"""Reading servers' answers: the first choice, a log-prob value, a chat answer's text and the
alternatives of its first generated token, llama-server's native ``/completion`` answers (usage,
the forced tokens' log-probs). Anything malformed raises
:class:`~specem_core.backends.http.errors.ServerResponseError`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from specem_core.backends.http.errors import AlignmentError, ServerResponseError

LOGPROB_FLOOR = -1.0e4
"""Log-probs below this (or -inf) are clamped, so means and softmaxes stay finite."""


def logprob_value(value: Any) -> float | None:
    """A log-prob from a server's answer (``None`` stays ``None``; -inf and tiny values are clamped).

    Raises:
        ServerResponseError: not a number, or NaN.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ServerResponseError(f"log-prob is not a number: {value!r}")
    v = float(value)
    if math.isnan(v):
        raise ServerResponseError("log-prob is NaN")
    return max(v, LOGPROB_FLOOR)


def first_choice(body: Any) -> dict[str, Any]:
    """``choices[0]`` of an answer.

    Raises:
        ServerResponseError: the answer is not an object with a non-empty ``choices`` list.
    """
    if not isinstance(body, dict):
        raise ServerResponseError(f"expected a JSON object, got {type(body).__name__}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerResponseError("answer has no choices")
    return choices[0]


def chat_content(body: Any) -> str:
    """The text of a chat answer's first message (``""`` for ``null`` content)."""
    choice = first_choice(body)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ServerResponseError("chat answer has no message")
    content = message.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ServerResponseError("chat message content is not a string")
    return content


def chat_top_logprobs(body: Any) -> list[tuple[str, float]] | None:
    """``(token, logprob)`` alternatives of the first generated token, or ``None``."""
    choice = first_choice(body)
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
        value = logprob_value(item.get("logprob"))
        if value is not None:
            out.append((item["token"], value))
    token, value = first.get("token"), logprob_value(first.get("logprob"))
    if isinstance(token, str) and value is not None and all(t != token for t, _ in out):
        out.append((token, value))
    return out


def native_usage(answer: Any, prompt: int) -> dict[str, Any]:
    """A llama-server ``/completion`` answer's prompt tokens and what it read from its KV cache
    (``timings.cache_n``), as an OpenAI ``usage`` (``prompt``: the tokens sent, where it says none)."""
    timings = answer.get("timings") if isinstance(answer, dict) else None
    cached = timings.get("cache_n") if isinstance(timings, dict) else None
    evaluated = answer.get("tokens_evaluated") if isinstance(answer, dict) else None
    return {
        "prompt_tokens": evaluated if isinstance(evaluated, int) else prompt,
        "prompt_tokens_details": {"cached_tokens": cached if isinstance(cached, int) else None},
    }


def completion_logprobs(answer: Any, expected: Sequence[int]) -> list[float]:
    """The log-probs of the tokens a llama-server ``/completion`` answer generated (its
    ``completion_probabilities``, from the logits before sampling), which must be ``expected``.

    Raises:
        AlignmentError: other tokens, or another number of them, came back.
    """
    rows = answer.get("completion_probabilities") if isinstance(answer, dict) else None
    if not isinstance(rows, list):
        raise ServerResponseError("the answer has no completion_probabilities (n_probs)")
    ids = [row.get("id") if isinstance(row, dict) else None for row in rows]
    if ids != list(expected):
        raise AlignmentError(f"the server generated tokens {ids} where {list(expected)} were forced")
    values = [logprob_value(row.get("logprob")) for row in rows]
    if any(v is None for v in values):
        raise AlignmentError("a forced token came back without its log-prob")
    return [float(v) for v in values if v is not None]
