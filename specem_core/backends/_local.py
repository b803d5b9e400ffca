"""What the local backends (llama.cpp and transformers) share: drafts, scores, healing, vocabulary
queries and the prefix cache across requests.

A session keeps the draft it made this round so that scoring its own candidate costs nothing: the
raw logit and log-prob of every picked token were recorded while drafting. The rules for where a
draft ends (length cap, a multi-byte character finished, a line end, the chat format's turn-stop
strings) and token healing are written once here, over a few hooks each backend implements
(:class:`LocalSession`). The prefix cache across requests is
:mod:`specem_core.backends._prefix_cache`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from specem_core.backends._prefix_cache import common_prefix
from specem_core.backends.base import MemberSession, SamplingParams, SessionRequest
from specem_core.copies import first_word_done, opens_with
from specem_core.errors import ContextWindowError
from specem_core.types import Candidate, CandidateScore, Draft

UTF8_EXTRA_TOKENS = 4
"""Extra tokens a draft may take to finish a multi-byte character split by the length cap."""
T = TypeVar("T")

AVOID_TRIES = 8
"""How many picks a draft refuses for starting an avoided word before it takes the next one."""


@dataclass
class DraftState:
    """A session's draft of the current round."""

    ids: list[int]
    token_scores: list[tuple[float, float]]
    """(raw logit, log-prob) of each drafted token, as the drafter saw them."""
    eos_score: tuple[float, float] | None
    ended: bool
    text: str
    fed: int
    """How many of ``ids`` are in the cache (all but the last, unless the draft ended)."""
    canonical: bool
    """False when the text was cut (turn-stop string, incomplete character) or healed."""

    def own_score(
        self, cand: Candidate, *, resp_len: int, lcp: int, new_ids: Sequence[int], with_eos: bool
    ) -> CandidateScore | None:
        """The candidate's score from the recorded token scores when it is exactly this draft
        (same text, same canonical tokens after the committed ids), else None."""
        if (
            self.canonical
            and self.text == cand.text
            and self.ended == cand.ended
            and lcp == resp_len
            and list(new_ids) == self.ids
            and (not with_eos or self.eos_score is not None)
        ):
            own = list(self.token_scores) + ([self.eos_score] if with_eos and self.eos_score else [])
            return mean_score(own)
        return None


def mean_score(scores: Sequence[tuple[float, float]]) -> CandidateScore:
    """Mean raw logit and mean log-prob of ``(raw, log-prob)`` pairs."""
    if not scores:
        return CandidateScore(mean_logit=0.0, mean_logprob=0.0, n_tokens=0)
    return CandidateScore(
        mean_logit=sum(s[0] for s in scores) / len(scores),
        mean_logprob=sum(s[1] for s in scores) / len(scores),
        n_tokens=len(scores),
    )


Pending = tuple[int, str, list[int], int, bool]
"""A candidate to score in a forward pass: (index, text, committed+text ids, common prefix with the
committed ids, whether its end-of-turn token is scored too)."""


def plan_scores(
    candidates: Sequence[Candidate],
    *,
    encode: Callable[[str], list[int]],
    committed_text: str,
    committed_ids: Sequence[int],
    draft: DraftState | None,
    score_eos: bool,
) -> tuple[list[CandidateScore | None], list[Pending]]:
    """Which candidates need a forward pass: a session's own draft is scored from its recorded
    token scores; every other candidate is re-encoded together with the committed text (text is
    the source of truth) and listed as pending."""
    out: list[CandidateScore | None] = [None] * len(candidates)
    pending: list[Pending] = []
    for n, cand in enumerate(candidates):
        full = encode(committed_text + cand.text)
        lcp = common_prefix(committed_ids, full)
        new_ids = full[lcp:]
        with_eos = cand.ended and (score_eos or not new_ids)
        own = (
            draft.own_score(cand, resp_len=len(committed_ids), lcp=lcp, new_ids=new_ids, with_eos=with_eos)
            if draft
            else None
        )
        if own is not None:
            out[n] = own
            continue
        if not new_ids and not with_eos:
            with_eos = True  # nothing to score but the end of turn
        pending.append((n, cand.text, full, lcp, with_eos))
    return out, pending


def consistent(method: Callable[..., T]) -> Callable[..., T]:
    """Mark a session call that changes its KV state: a session whose last such call raised holds
    rows nobody can vouch for, and :meth:`LocalSession.reusable_prefix` then offers none."""

    @functools.wraps(method)
    def wrapper(self: LocalSession, *args: Any, **kwargs: Any) -> T:
        self._consistent = False
        result = method(self, *args, **kwargs)
        self._consistent = True
        return result

    return wrapper


class LocalVocabulary:
    """Vocabulary queries of a local member, from the text of each token (token healing).

    A member provides ``stop_ids``, ``suppress_ids``, ``encode_response`` and the hooks
    ``_token_texts`` (every token's text) and ``_decode_text`` (ids to text).
    """

    stop_ids: frozenset[int]
    suppress_ids: list[int]
    chat: Any
    """The member's :class:`~specem_core.chat_format.ChatFormat`."""

    def encode_response(self, text: str) -> list[int]:
        raise NotImplementedError

    def _token_texts(self) -> list[str]:
        raise NotImplementedError

    def _decode_text(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_prompt(self, request: SessionRequest) -> list[int]:
        """The member's own chat-formatted prompt as token ids (templates write BOS themselves;
        the plain format needs the tokenizer's own special tokens)."""
        text = self.chat.render(request.messages, request.tools)
        return self._tokenize_prompt(text, not self.chat.uses_template)

    def _tokenize_prompt(self, text: str, add_special: bool) -> list[int]:
        raise NotImplementedError

    def _never_drafted(self) -> set[int]:
        """Tokens no draft may contain (end of turn, control tokens)."""
        return set(self.stop_ids) | set(self.suppress_ids)

    def token_text(self, token: int) -> str:
        """The text one token stands for alone ('' for tokens that are not whole characters)."""
        texts = self._token_texts()
        return texts[token] if 0 <= token < len(texts) else ""

    def tokens_extending(self, prefix: str) -> list[int]:
        """Ids of the (non-special) tokens whose text starts with ``prefix`` (cached per prefix)."""
        cache: dict[str, list[int]] = self.__dict__.setdefault("_extending_cache", {})
        if prefix not in cache:
            banned = self._never_drafted()
            cache[prefix] = [i for i, t in enumerate(self._token_texts()) if t.startswith(prefix) and i not in banned]
            if len(cache) > 4096:
                cache.pop(next(iter(cache)))
        return list(cache[prefix])

    def token_texts_concatenate(self) -> bool:
        """True when the tokens' texts joined give the decoded text back (byte-level BPE, as SmolLM2
        and Qwen); SentencePiece tokenizers that drop a leading space are not healed."""
        if "_concatenates" not in self.__dict__:
            probe = "Hello world. It's 2024, e.g. www.example.com!"
            ids = self.encode_response(probe)
            joined = "".join(self.token_text(i) for i in ids)
            self.__dict__["_concatenates"] = bool(ids) and joined == self._decode_text(ids) == probe
        return bool(self.__dict__["_concatenates"])


class LocalMember(Protocol):
    """What a :class:`LocalSession` needs of its member (a local member: a
    :class:`LocalVocabulary` with a name and a context window). Each backend's session module
    extends it with what that backend's session uses (its member module imports the session
    module, so a session names its member by a protocol)."""

    name: str
    stop_ids: frozenset[int]
    suppress_ids: list[int]
    chat: Any
    """The member's :class:`~specem_core.chat_format.ChatFormat`."""

    @property
    def context_window(self) -> int | None: ...
    def encode_prompt(self, request: SessionRequest) -> list[int]: ...
    def encode_response(self, text: str) -> list[int]: ...
    def token_text(self, token: int) -> str: ...
    def tokens_extending(self, prefix: str) -> list[int]: ...
    def token_texts_concatenate(self) -> bool: ...


def _larger_window(prompt_tokens: int) -> int:
    """A context window that holds the prompt and a typical answer (a power of two, for the message)."""
    return 1 << max(12, (prompt_tokens + 1024 - 1).bit_length())


class LocalSession(MemberSession):
    """The request state both local backends keep, and what they do the same way with it.

    State: the prompt ids, the committed response (text and canonical ids), this round's draft,
    and which response ids the KV cache holds (for the prefix cache). A backend implements the
    KV hooks ``_set_length``, ``_feed``, ``_cache_length``, ``_committed_head`` /
    ``_set_committed_head`` (next-token logits after the committed prefix), ``_draft_from`` (its
    drafting loop) and the text hooks ``_draft_text``, ``_incomplete``, ``_has_newline``.
    """

    _m: LocalMember

    def _start(self, member: LocalMember, request: SessionRequest) -> None:
        """Encode the prompt and check that it fits (no model work)."""
        self._prompt_ids: list[int] = member.encode_prompt(request)
        if not self._prompt_ids:
            raise ContextWindowError(f"{member.name}: the prompt encodes to no tokens")
        window = member.context_window
        if window and len(self._prompt_ids) + 2 > window:
            raise ContextWindowError(
                f"the prompt is {len(self._prompt_ids)} tokens for member {member.name!r}, "
                f"whose context window is {window}; shorten the conversation, or raise the window of a "
                f"llama.cpp member with n_ctx: member_kwargs={{'n_ctx': {_larger_window(len(self._prompt_ids))}}} "
                f"(SpecEM.from_preset, ChatSpecEM, SpecEMLLM), load_member(..., n_ctx=...) or "
                f"--n-ctx {_larger_window(len(self._prompt_ids))} (specem chat / serve); a transformers member's "
                "window is its model's maximum"
            )
        self._text = ""
        self._resp_ids: list[int] = []
        self._draft: DraftState | None = None
        self._cached_resp: list[int] = []
        """The response ids whose KV rows follow the prompt's in the cache (committed ones; the
        cache may hold draft rows beyond them)."""
        self._consistent = True
        self.cached_tokens = 0
        """Prompt tokens read from the prefix cache instead of prefilled (this request)."""
        self.prefilled_tokens = 0
        """Tokens this session ran through the model in prefills (prompt and catch-up feeds)."""

    # -- protocol ---------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        """Prompt length in this member's tokens."""
        return len(self._prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Committed response length in this member's tokens."""
        return len(self._resp_ids)

    def _committed_len(self) -> int:
        return len(self._prompt_ids) + len(self._resp_ids)

    def reusable_prefix(self) -> list[int]:
        """The token ids whose KV rows this session can hand to a later request: the prompt and
        the committed response the cache holds, up to the cache's length; none after a failed call."""
        if not self._consistent:
            return []
        held = self._prompt_ids + self._cached_resp
        return held[: min(len(held), self._cache_length())]

    @consistent
    def draft(
        self,
        max_tokens: int,
        sampling: SamplingParams,
        *,
        hints: Sequence[Candidate] = (),
        score_eos: bool = False,
    ) -> Draft:
        """Continue from the committed prefix by up to ``max_tokens`` tokens (token healing first,
        when asked); ``hints`` go to the backend's :meth:`_draft_plain` (the llama.cpp session
        drafts speculatively over them; the transformers session does not use them)."""
        self._to_committed()
        if sampling.token_healing:
            healed = self._draft_healed(max_tokens, sampling)
            if healed is not None:
                return healed
        return self._draft_plain(max_tokens, sampling, hints, score_eos)

    def _plan(
        self, candidates: Sequence[Candidate], score_eos: bool
    ) -> tuple[list[CandidateScore | None], list[Pending]]:
        """:func:`plan_scores` on this session's committed text, ids and draft."""
        return plan_scores(
            candidates,
            encode=self._m.encode_response,
            committed_text=self._text,
            committed_ids=self._resp_ids,
            draft=self._draft,
            score_eos=score_eos,
        )

    def _draft_won(self, text: str, full: list[int], final: bool) -> bool:
        """Whether the committed ``text`` (``full``: the response's ids with it) is this session's
        own canonical draft, whose KV rows can stay (an ended draft is only ever the final one)."""
        draft = self._draft
        return (
            draft is not None
            and draft.canonical
            and draft.text == text
            and (final or not draft.ended)
            and full == self._resp_ids + draft.ids
        )

    def _keep_draft_rows(self, full: list[int], final: bool) -> None:
        """Keep the winning draft's rows as the committed prefix; its last token is fed unless the
        commit is ``final`` (nobody continues from there; the fed rows still go to the prefix cache)."""
        draft = self._draft
        assert draft is not None
        self._set_length(self._committed_len() + draft.fed)
        if final:
            self._cached_resp = self._resp_ids + draft.ids[: draft.fed]
            return
        unfed = draft.ids[draft.fed :]
        if unfed:
            self._set_head(self._feed(unfed))
        self._cached_resp = full

    def _extend_to(self, full: list[int], cached: list[int] | None = None) -> None:
        """Roll the cache back to the common prefix of ``full`` and the cached response ids
        (``cached``, default the committed ones) and feed the rest."""
        lcp = common_prefix(self._resp_ids if cached is None else cached, full)
        start = len(self._prompt_ids) + lcp
        tail = full[lcp:]
        if not tail:  # nothing new: recompute the logits of the last kept token
            start -= 1
            tail = [(self._prompt_ids + full)[start]]
        self._set_length(start)
        self._set_head(self._feed(tail))

    # -- hooks ------------------------------------------------------------------------------
    def _set_head(self, logits: Any) -> None:
        """Next-token logits after the last position the cache holds."""
        raise NotImplementedError

    def _to_committed(self) -> None:
        """Make sure the cache holds the committed prefix and its next-token logits are known."""
        raise NotImplementedError

    def _draft_plain(
        self, max_tokens: int, sampling: SamplingParams, hints: Sequence[Candidate], score_eos: bool
    ) -> Draft:
        """The backend's draft from the committed prefix (no healing)."""
        raise NotImplementedError

    def _set_length(self, n: int) -> None:
        raise NotImplementedError

    def _feed(self, ids: Sequence[int]) -> Any:
        raise NotImplementedError

    def _cache_length(self) -> int:
        raise NotImplementedError

    def _committed_head(self) -> Any:
        raise NotImplementedError

    def _set_committed_head(self, logits: Any) -> None:
        raise NotImplementedError

    def _draft_from(self, logits: Any, allowed_first: list[int], max_tokens: int, sampling: SamplingParams) -> Draft:
        raise NotImplementedError

    def _draft_text(self, ids: Sequence[int]) -> str:
        """The text ``ids`` add after the committed response."""
        raise NotImplementedError

    def _incomplete(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` end inside a multi-byte character."""
        raise NotImplementedError

    def _has_newline(self, token: int) -> bool:
        raise NotImplementedError

    # -- drafting rules -----------------------------------------------------------------------
    def _avoiding(
        self, ids: Sequence[int], token: int, sampling: SamplingParams, repick: Callable[[list[int]], int]
    ) -> int:
        """``token``, or, while it would make the draft's first word one of
        ``sampling.avoid_words`` (``copy_break``), ``repick`` of the tokens refused so far
        (``AVOID_TRIES`` at most): the next best pick that starts another word."""
        if not sampling.avoid_words or (ids and first_word_done(self._draft_text(ids))):
            return token
        refused: list[int] = []
        while len(refused) < AVOID_TRIES and opens_with(self._draft_text([*ids, token]), sampling.avoid_words):
            refused.append(token)
            token = repick(refused)
        return token

    def _record_pick(
        self,
        token: int,
        score: tuple[float, float],
        ids: list[int],
        scores: list[tuple[float, float]],
        history: set[int],
    ) -> tuple[float, float] | None:
        """Add a picked token and its (raw logit, log-prob) to the draft; when the token ends the
        turn it is not added (it is never part of a draft's text) and its score comes back."""
        if token in self._m.stop_ids:
            return score
        ids.append(token)
        scores.append(score)
        history.add(token)
        return None

    def _draft_is_full(self, ids: Sequence[int], token: int, max_tokens: int, sampling: SamplingParams) -> bool:
        """Whether the draft ends after ``token`` (the last of ``ids``): the length cap once no
        character is left half-written (a few tokens more at most), or a line end when asked."""
        if len(ids) >= max_tokens and (not self._incomplete(ids) or len(ids) >= max_tokens + UTF8_EXTRA_TOKENS):
            return True
        return sampling.stop_at_line_end and self._has_newline(token)

    def _finish_draft(
        self,
        ids: list[int],
        scores: list[tuple[float, float]],
        eos_score: tuple[float, float] | None,
        fed: int,
        reused: int = 0,
    ) -> Draft:
        """Record the round's draft and return it: never half a character (trailing partial bytes
        are dropped), cut at the chat format's turn-stop strings."""
        ended = eos_score is not None
        canonical = True
        while ids and self._incomplete(ids):  # never hand out half a character
            ids.pop()
            scores.pop()
            ended, eos_score, canonical = False, None, False
        text = self._draft_text(ids)
        for stop in self._m.chat.turn_stop_strings:
            cut = text.find(stop)
            if cut != -1:
                text, ended, canonical = text[:cut], True, False
        fed = min(fed, len(ids))
        self._draft = DraftState(ids, scores, eos_score, ended, text, fed, canonical)
        return Draft(text=text, ended=ended, tokens=len(ids) + (1 if eos_score is not None else 0), reused=reused)

    def _draft_healed(self, max_tokens: int, sampling: SamplingParams) -> Draft | None:
        """Token healing: drop the last committed token and redraw it among the tokens whose text
        extends its text; the draft is what comes after the committed text. None when not applicable
        (nothing committed, a tokenizer whose single tokens do not decode to their text, no choice)."""
        if not self._resp_ids or not self._m.token_texts_concatenate():
            return None
        last = self._resp_ids[-1]
        tail = self._m.token_text(last)
        if not tail or not self._text.endswith(tail):
            return None
        allowed = self._m.tokens_extending(tail)
        if len(allowed) <= 1:
            return None  # only the token itself: nothing to heal
        n = self._committed_len()
        committed = self._prompt_ids + self._resp_ids
        saved_resp, saved_text = self._resp_ids, self._text
        self._set_length(n - 2)
        logits = self._feed([committed[n - 2]])  # next-token logits before the last committed token
        self._resp_ids, self._text = saved_resp[:-1], saved_text[: len(saved_text) - len(tail)]
        try:
            draft = self._draft_from(logits, allowed, max_tokens + 1, sampling)
        finally:
            self._resp_ids, self._text = saved_resp, saved_text
            self._set_length(n - 1)  # back to the committed prefix: the healed draft's KV is not reused
            self._set_committed_head(self._feed([committed[n - 1]]))
        assert self._draft is not None
        if not draft.text.startswith(tail):
            self._draft = None
            return self._draft_from(self._committed_head(), [], max_tokens, sampling)
        text = draft.text[len(tail) :]
        # the winner is re-encoded (canonically) by every member at commit; this draft's own scores
        # cover the redrawn token too, so it is scored like any other member's candidate
        self._draft = replace(self._draft, text=text, canonical=False)
        return Draft(text=text, ended=draft.ended, tokens=draft.tokens)
