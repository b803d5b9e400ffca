"""Reading servers' answers: the first choice, a log-prob value, a chat answer's text and the
alternatives of its first generated token. Anything malformed raises
:class:`~specem_core.backends.http.errors.ServerResponseError`."""

from __future__ import annotations

import math
from typing import Any

from specem_core.backends.http.errors import ServerResponseError

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
