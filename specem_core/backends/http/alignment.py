"""Echo log-probs mapped onto candidate text spans: parsing, alignment, span scores.

A verifier sends ``prompt + R + candidate [+ end-of-turn]`` to ``/v1/completions`` with ``echo``
and ``logprobs``; the candidate's tokens are located by character offsets (``text_offset``,
re-anchored and checked against the text that was sent, see :func:`align_echo`), and the
log-probs of exactly those tokens are read (:func:`span_logprobs`). A server whose echo
log-probs are shifted by one position (llama-cpp-python without BOS) is corrected by reading each
token's log-prob from the previous slot's ``top_logprobs``. Whatever cannot be matched with
certainty raises :class:`~specem_core.backends.http.errors.AlignmentError`: nothing is
mis-scored silently.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specem_core.backends.http.errors import AlignmentError, ServerResponseError
from specem_core.backends.http.responses import first_choice, logprob_value


# -- echo log-probs: parsing and alignment -------------------------------------------------
@dataclass(frozen=True)
class EchoLogprobs:
    """``choices[0]`` of a ``/v1/completions`` answer with ``echo`` and ``logprobs``."""

    text: str
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    finish_reason: str | None = None


def parse_echo_logprobs(body: Any) -> EchoLogprobs:
    """Validate and extract echo log-probs.

    Raises:
        ServerResponseError: missing fields, lists of different lengths, wrong types.
    """
    choice = first_choice(body)
    text = choice.get("text")
    lp = choice.get("logprobs")
    if not isinstance(text, str) or not isinstance(lp, dict):
        raise ServerResponseError("completion has no text or no logprobs")
    tokens, values, tops, offsets = (lp.get(k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    if not all(isinstance(x, list) for x in (tokens, values, offsets)):
        raise ServerResponseError("logprobs lack tokens / token_logprobs / text_offset lists")
    assert isinstance(tokens, list)
    assert isinstance(values, list)
    assert isinstance(offsets, list)
    if tops is None:
        tops = [None] * len(tokens)
    if not isinstance(tops, list) or not (len(tokens) == len(values) == len(offsets) == len(tops)):
        raise ServerResponseError(
            f"logprob lists differ in length: tokens={len(tokens)} token_logprobs={len(values)} "
            f"text_offset={len(offsets)} top_logprobs={len(tops) if isinstance(tops, list) else tops!r}"
        )
    if not tokens:
        raise ServerResponseError("echo returned no tokens")
    if not all(isinstance(t, str) for t in tokens):
        raise ServerResponseError("logprobs.tokens must be strings")
    if not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise ServerResponseError("logprobs.text_offset must be integers")
    if any(b < a for a, b in itertools.pairwise(offsets)):
        raise ServerResponseError("logprobs.text_offset is not monotonic")
    parsed_tops: list[dict[str, float] | None] = []
    for top in tops:
        if top is None:
            parsed_tops.append(None)
        elif isinstance(top, dict):
            parsed_tops.append({str(k): v for k, x in top.items() if (v := logprob_value(x)) is not None})
        else:
            raise ServerResponseError(f"top_logprobs entries must be objects, got {type(top).__name__}")
    finish = choice.get("finish_reason")
    return EchoLogprobs(
        text=text,
        tokens=list(tokens),
        token_logprobs=[logprob_value(v) for v in values],
        top_logprobs=parsed_tops,
        text_offset=list(offsets),
        finish_reason=finish if isinstance(finish, str) else None,
    )


@dataclass(frozen=True)
class EchoAlignment:
    """Where the echoed entries covering the text sit in the text we sent."""

    offset_shift: int
    """``C``: sent position = ``text_offset + C`` (servers that drop special-token text from
    offsets, like llama-cpp-python, have ``C > 0``; it is constant after the prompt's last special)."""
    text_entries: list[int]
    """Entries covering ``[region_start, text_end)``, in order."""
    starts: list[int]
    ends: list[int]
    """Sent-text span of each entry in ``text_entries``."""
    next_entry: int | None
    """The first entry after the text (the end-of-turn entry when one was appended)."""


def _matches(piece: str, token: str) -> bool | None:
    """True exact, None lenient (split multi-byte character), False mismatch."""
    if piece == token:
        return True
    if not piece.isascii() and (token == "" or "\ufffd" in token or token in piece or piece in token):
        return None
    return False


def align_echo(
    sent: str,
    echo: EchoLogprobs,
    *,
    region_start: int,
    text_end: int,
    eot_text: str | None = None,
    max_generated: int = 1,
    known_shift: int | None = None,
) -> EchoAlignment:
    """Map echoed entries onto ``sent[region_start:text_end]`` (text without special tokens).

    ``sent`` is ``prompt + text`` plus ``eot_text`` when one was appended; the server may have
    echoed up to ``max_generated`` generated tokens after it. Offsets are tried under a few
    hypotheses for the constant ``C``, each assuming that one of the last entries is the text's
    last token (ending at ``text_end``). A hypothesis holds when (1) walking back from it, every
    entry down to ``region_start`` spells exactly the sent text at its place, and (2) what follows
    it is the end-of-turn entry (when sent) and at most ``max_generated`` generated entries that
    spell the start of the generated text. Exactly one must hold (``known_shift``, from earlier
    answers to the same prompt, wins).

    Raises:
        AlignmentError: no hypothesis, or several, fit.
    """
    generated = echo.text[len(sent) :] if echo.text.startswith(sent) else ""
    # a text that opens with a multi-byte character (or U+FFFD) may open with '' entries (its bytes)
    leading_partial = not sent[region_start : region_start + 1].isascii()
    try:
        fit = _align(sent, echo, generated, region_start, text_end, eot_text, max_generated, known_shift)
        return _absorb_partial_entries(fit, echo, leading_partial)
    except AlignmentError:
        if "\ufffd" not in sent[:text_end]:
            raise
    # vLLM's detokenizer drops U+FFFD characters from echoed tokens and offsets (it takes them for
    # an unfinished multi-byte character): align on the text without them, then map positions back.
    kept = [i for i, ch in enumerate(sent) if ch != "\ufffd"]
    stripped = "".join(sent[i] for i in kept)
    before = [0] * (len(sent) + 1)  # before[i]: kept characters in sent[:i]
    for i, ch in enumerate(sent):
        before[i + 1] = before[i] + (ch != "\ufffd")
    fit = _align(
        stripped, echo, generated, before[region_start], before[text_end], eot_text, max_generated, known_shift
    )
    fit = _absorb_partial_entries(fit, echo, leading_partial)
    back = [*kept, len(sent)]  # stripped position -> sent position (after any U+FFFD run there)
    return replace(fit, starts=[back[x] for x in fit.starts], ends=[back[x] for x in fit.ends])


def _absorb_partial_entries(fit: EchoAlignment, echo: EchoLogprobs, leading_partial: bool) -> EchoAlignment:
    """Give the '' entries of a character split over several tokens the span of the entry that
    completes it, so the span picks all its tokens (servers like vLLM report the bytes as '' at the
    character's offset); take in such entries just before the text when the text opens with one."""
    entries, starts, ends = list(fit.text_entries), list(fit.starts), list(fit.ends)
    toks, offs = echo.tokens, echo.text_offset
    while leading_partial and entries and entries[0] > 0:
        j = entries[0] - 1
        if toks[j] != "" or offs[j] != offs[entries[0]]:
            break
        entries.insert(0, j)
        starts.insert(0, starts[0])
        ends.insert(0, starts[0])
    for k in range(len(entries) - 2, -1, -1):
        if toks[entries[k]] == "" and starts[k] == ends[k]:
            starts[k], ends[k] = starts[k + 1], ends[k + 1]
    return replace(fit, text_entries=entries, starts=starts, ends=ends)


def _align(
    sent: str,
    echo: EchoLogprobs,
    generated: str,
    region_start: int,
    text_end: int,
    eot_text: str | None,
    max_generated: int,
    known_shift: int | None,
) -> EchoAlignment:
    offs, toks = echo.text_offset, echo.tokens
    n = len(toks)
    hypotheses: list[tuple[int, int]] = []  # (last text entry, C)
    for i in range(n - 1, max(-1, n - 4 - max_generated), -1):
        if i + 1 < n:
            hypotheses.append((i, text_end - offs[i + 1]))
        hypotheses.append((i, text_end - offs[i] - len(toks[i])))
    fits: dict[tuple[int, int], tuple[int, EchoAlignment]] = {}
    for last, c in hypotheses:
        if c < 0 or (last, c) in fits:
            continue
        if not _tail_fits(toks[last + 1 :], eot_text, generated, max_generated):
            continue
        if toks[last] == "" and sent[text_end - 1 : text_end].isascii():
            continue  # the text's last token has a width (unless a split multi-byte character)
        fit = _walk_back(sent, echo, last, c, region_start, text_end)
        if fit is not None:
            fits[(last, c)] = fit
    for last, c in list(fits):
        if toks[last] == "" and (last - 1, c) in fits:
            del fits[(last, c)]  # a trailing '' adds no text: it is the generated (or end-of-turn) entry
    if known_shift is not None:
        known = [f for (_, c), f in fits.items() if c == known_shift]
        if len(known) == 1:
            return known[0][1]
    if not fits:
        raise AlignmentError("echoed tokens do not spell the text that was sent; cannot locate the candidate")
    ranked = sorted(fits.values(), key=lambda f: -f[0])
    if len(ranked) > 1 and ranked[1][0] == ranked[0][0]:
        raise AlignmentError("echoed tokens fit the sent text in more than one way; refusing to guess")
    return ranked[0][1]


def _tail_fits(after: Sequence[str], eot_text: str | None, generated: str, max_generated: int) -> bool:
    rest = list(after)
    if eot_text is not None:
        if not rest or rest[0] not in (eot_text, ""):
            return False
        rest = rest[1:]
    if len(rest) > max_generated:
        return False
    joined = "".join(rest)
    return generated == "" or joined == "" or generated.startswith(joined)


def _walk_back(
    sent: str, echo: EchoLogprobs, last: int, c: int, region_start: int, text_end: int
) -> tuple[int, EchoAlignment] | None:
    """Check hypothesis (``last`` entry ends the text, offset shift ``c``); count exact matches."""
    offs, toks = echo.text_offset, echo.tokens
    entries: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    exact = 0
    end = text_end
    j = last
    while j >= 0:
        start = offs[j] + c
        if start > end:
            return None
        if start >= region_start:
            ok = _matches(sent[start:end], toks[j])
            if ok is False:
                return None
            exact += 1 if ok and toks[j] else 0
        entries.append(j)
        starts.append(start)
        ends.append(end)
        if start <= region_start:
            break
        end = start
        j -= 1
    else:
        return None  # ran out of entries before reaching the region's start
    if exact == 0:
        return None
    entries.reverse()
    starts.reverse()
    ends.reverse()
    next_entry = last + 1 if last + 1 < len(toks) else None
    return exact, EchoAlignment(c, entries, starts, ends, next_entry)


@dataclass(frozen=True)
class SpanScore:
    logprobs: list[float]
    missing: int
    """Tokens whose log-prob a shifted server did not list: bounded by the slot's lowest listed one."""
    eos_unknown: bool = False
    """A shifted server lists special tokens as ``''``: the end-of-turn log-prob is unknown (not scored)."""


def top_token(top: Mapping[str, float] | None) -> str | None:
    """The most likely token of a ``top_logprobs`` slot (``None``: an empty slot)."""
    if not top:
        return None
    return max(top.items(), key=lambda kv: kv[1])[0]


def span_logprobs(
    echo: EchoLogprobs,
    alignment: EchoAlignment,
    *,
    span_start: int,
    span_end: int,
    with_eos: bool,
    eot_text: str | None,
    shift: int,
) -> SpanScore:
    """Log-probs of the entries overlapping ``[span_start, span_end)`` (+ the end-of-turn entry).

    ``shift=0``: ``token_logprobs[i]`` belongs to token ``i``. ``shift=1``: it belongs to the
    previous token, so token ``i``'s log-prob is read from ``top_logprobs[i-1]``.

    Raises:
        AlignmentError: the end-of-turn entry is not where it was sent, or a value is absent.
    """
    picked = [
        j
        for j, s, e in zip(alignment.text_entries, alignment.starts, alignment.ends, strict=True)
        if e > span_start and s < span_end
    ]
    eos_unknown = False
    if with_eos:
        eos = alignment.next_entry
        if eos is None or eot_text is None or echo.tokens[eos] not in (eot_text, ""):
            raise AlignmentError("the end-of-turn token is not where it was sent")
        if shift == 1 and echo.tokens[eos] == "":
            eos_unknown = True
        else:
            picked.append(eos)
    values: list[float] = []
    missing = 0
    for j in picked:
        if shift == 0:
            v = echo.token_logprobs[j]
            if v is None:
                raise AlignmentError(f"no log-prob for echoed token {j}")
            values.append(v)
            continue
        prev = echo.top_logprobs[j - 1] if j >= 1 else None
        if not prev:
            raise AlignmentError(f"no top_logprobs before echoed token {j}")
        token = echo.tokens[j]
        if token in prev:
            values.append(prev[token])
        else:  # an upper bound: the lowest of the slot's top-k (its own token's entry left out)
            missing += 1
            listed = [v for t, v in prev.items() if t != echo.tokens[j - 1]] or list(prev.values())
            values.append(min(listed))
    return SpanScore(values, missing, eos_unknown)


def near_tie(top: Mapping[str, float] | None) -> bool:
    """The slot's two most likely tokens are within 1e-3 nats (a greedy pick may go either way)."""
    if not top or len(top) < 2:
        return False
    best = sorted(top.values(), reverse=True)[:2]
    return best[0] - best[1] < 1e-3
