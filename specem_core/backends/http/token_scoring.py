"""Exact scoring that reads the server's prefix cache: the ``prompt_tail`` and ``next_token`` paths
(vLLM) and the ``forced`` path (llama-cpp-python); the paths are described in
:mod:`specem_core.backends.http.probe`.

Both work on the server's own tokens. The candidate's tokens are those of the server's
tokenization of ``prompt + answer + candidate [+ end of turn]`` after the longest prefix it shares
with the tokenization of ``prompt + answer`` (a boundary merge re-reads the answer's last token, as
the local backends do), so a row equals the echo path's row up to the numerics of computing a
position in a batch of one rather than in a prefill.

* ``prompt_tail``: one ``/inference/v1/generate`` request per candidate (token ids in, prompt
  log-probs out, ``skip_reading_prefix_cache: false``, ``detokenize: false``): the log-prob of
  every position after the ``cached_tokens`` the answer reports is computed in this request, and
  those are the values taken (a cached position's value is not computed: vLLM 0.32 sends whatever
  its buffer held, and would fail detokenizing it). Candidate tokens at or before that point (the
  cache held a block of them: a candidate scored before) come from the member's own draft or the
  ``next_token`` path, and so does a whole candidate whose answer vLLM could not write (a 400 when
  one of those unwritten values is NaN or +inf, which JSON cannot carry: about one request in
  twenty on the benchmark's conversations).
* ``next_token``: one ``/v1/completions`` request per candidate token whose log-prob is not
  known yet, its prompt the token ids before it and ``logprob_token_ids`` naming it (``max_tokens``
  1); all of a round's requests run at once and identical ones are sent once. A token of the
  member's own draft at the same place (same ids before it) takes the draft's log-prob: vLLM
  returns the raw log-prob of every token it generates (``logprobs: 0``).
* ``forced``: one streamed ``/v1/completions`` request per candidate on the prompt text, with a
  grammar of the candidate's token ids (``root ::= <[id]> <[id]> ...``): the server generates
  exactly those tokens and lists the log-prob of each (its log-probs are read from the logits
  before any sampling step, so forcing does not change them). Streaming matters: without it,
  llama-cpp-python turns every prompt position's logits into log-probs before answering. Its
  server cuts a stream short when another request waits for the model (``--interrupt_requests``,
  on by default), so a member's requests to one such server go one at a time (:func:`server_lock`)
  and a stream cut by someone else's request is asked again without streaming. A token that is
  only part of a character (a byte of a character split over several tokens) is never forced:
  llama.cpp's grammar then rejects every token and aborts the server; such candidates (and
  candidates whose text a tokenizer may read as a special token) take the echo path.

  On llama.cpp's own ``llama-server`` the same path goes through its native ``/completion``: the
  prompt is sent as token ids (``/tokenize`` gave them, with each token's piece: a piece that is not
  whole characters comes back as bytes), ``n_probs`` lists each generated token's log-prob from the
  logits before sampling, and a grammar that has matched all its tokens lets only an end of
  generation through, whose log-prob the server lists too: an ended candidate is scored exactly
  there, with no echo (the server has none). The server decodes requests on parallel slots, so no
  lock: a round's candidates are forced side by side.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specem_core.backends.http.errors import AlignmentError, HTTPMemberError, ServerResponseError
from specem_core.backends.http.interface import MemberStats, ServerMember
from specem_core.backends.http.probe import CACHE_PATHS, ScorePath, root_url
from specem_core.backends.http.responses import completion_logprobs, first_choice, logprob_value, native_usage

SPECIAL_TEXT = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?s>")
"""Text a server's tokenizer may read as a special token: never forced through a grammar (an
end-of-generation token in a llama.cpp grammar aborts the server)."""


_LOCKS: dict[tuple[int, str], asyncio.Lock] = {}


def server_lock(root: str) -> asyncio.Lock:
    """One lock per server (and event loop): the forced path's requests to one llama.cpp server
    are sent one at a time, so that none cuts another's stream short."""
    key = (id(asyncio.get_running_loop()), root)
    lock = _LOCKS.get(key)
    if lock is None:
        lock = _LOCKS[key] = asyncio.Lock()
    return lock


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def token_grammar(ids: Sequence[int]) -> str:
    """A llama.cpp grammar that accepts exactly these tokens, in order."""
    return "root ::= " + " ".join(f"<[{int(i)}]>" for i in ids)


def cached_tokens(body: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer, when the server reports it."""
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_tokens(body: Any) -> int | None:
    """``usage.prompt_tokens`` of an answer, when reported."""
    usage = body.get("usage") if isinstance(body, dict) else None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def token_list(body: Any, key: str = "tokens") -> list[int]:
    """The id list of a tokenizer endpoint's answer.

    Raises:
        ServerResponseError: no list of integers there.
    """
    ids = body.get(key) if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ServerResponseError(f"tokenizer answer has no {key!r} list of integers")
    return list(ids)


def next_token_logprob(body: Any, token: int) -> float:
    """The log-prob of ``token`` in a ``logprob_token_ids`` answer (``return_tokens_as_token_ids``).

    Raises:
        AlignmentError: the answer does not list that token.
    """
    logprobs = first_choice(body).get("logprobs")
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    slot = tops[0] if isinstance(tops, list) and tops and isinstance(tops[0], dict) else None
    value = logprob_value(slot.get(f"token_id:{token}")) if slot is not None else None
    if value is None:
        raise AlignmentError(f"the server did not list the log-prob of token {token} it was asked for")
    return value


def prompt_tail_logprobs(body: Any, ids: Sequence[int]) -> dict[int, float]:
    """Position -> log-prob of ``ids[position]`` for every position a ``/inference/v1/generate``
    answer computed: those after its ``cached_tokens`` (a position's log-prob comes from the state
    of the one before it, and the cached ones were never computed).

    Raises:
        ServerResponseError: the answer has no prompt log-probs or does not say what it read from
            its cache (vLLM without ``--enable-prompt-tokens-details``).
        AlignmentError: a computed position does not list its token.
    """
    rows = body.get("prompt_logprobs") if isinstance(body, dict) else None
    cached = cached_tokens(body)
    if not isinstance(rows, list) or len(rows) != len(ids):
        raise ServerResponseError("the answer has no prompt log-probs for every prompt token")
    if cached is None:
        raise ServerResponseError("the answer does not report its cached prompt tokens")
    out: dict[int, float] = {}
    for p in range(max(1, cached + 1), len(ids)):
        entry = rows[p].get(str(ids[p])) if isinstance(rows[p], dict) else None
        value = logprob_value(entry.get("logprob")) if isinstance(entry, dict) else None
        if value is None:
            raise AlignmentError(f"the server did not list the log-prob of prompt token {p}")
        out[p] = value
    return out


def forced_logprobs(chunks: Sequence[Any], expected: int) -> list[float]:
    """The log-probs of the tokens a forced, streamed completion generated, in order.

    Raises:
        AlignmentError: not exactly ``expected`` tokens came back.
    """
    values: list[float] = []
    for chunk in chunks:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            continue
        lp = choices[0].get("logprobs")
        if not isinstance(lp, dict):
            continue
        for v in lp.get("token_logprobs") or []:
            value = logprob_value(v)
            if value is None:
                raise AlignmentError("a forced token came back without its log-prob")
            values.append(value)
    if len(values) != expected:
        raise AlignmentError(f"the server generated {len(values)} tokens for a grammar of {expected}")
    return values


@dataclass
class DraftTokens:
    """What a draft request told about tokens (``next_token`` path): the prompt's ids and the
    generated ids with their log-probs."""

    prompt: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]


@dataclass
class ScoreCounts:
    """The requests one session's scoring sent and what the server said it read from its cache."""

    requests: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of the scoring requests (as the server counted them, where it did)."""
    cached_tokens: int | None = None
    """Of those, read from the server's prefix cache (``None``: the server does not say)."""
    from_draft: int = 0
    """Candidate tokens scored from the member's own draft (no request)."""
    echo_fallbacks: int = 0
    """Candidates scored through the echo path instead (an end of turn on ``forced``, special
    text, a prefix the server cannot be given as text)."""
    tail_fallbacks: int = 0
    """Candidates ``prompt_tail`` handed to ``next_token`` (vLLM could not write the answer)."""
    per_request: list[tuple[int, int | None]] = field(default_factory=list)
    """(prompt tokens, cached tokens) of each scoring request, in order."""

    def add(self, body: Any, stats: MemberStats | None = None) -> None:
        """Count one scoring request's answer (here and in the member's ``stats``)."""
        self.requests += 1
        prompt, cached = prompt_tokens(body), cached_tokens(body)
        self.prompt_tokens += prompt or 0
        if cached is not None:
            self.cached_tokens = (self.cached_tokens or 0) + cached
        self.per_request.append((prompt or 0, cached))
        if stats is not None:
            stats.score_requests += 1
            stats.score_prompt_tokens += prompt or 0
            stats.score_cached_tokens += cached or 0


class TokenScorer:
    """Scores candidates on the ``prompt_tail``, ``next_token`` or ``forced`` path for one session.

    ``score`` returns ``None`` when the path cannot score this candidate exactly (the caller then
    uses the echo path): text a server may read as a special token on ``forced``, or a prefix it
    cannot be given as text.
    """

    def __init__(
        self,
        member: ServerMember,
        path: ScorePath,
        add_special_tokens: bool,
        counts: ScoreCounts | None = None,
        *,
        count_in_member: bool = True,
    ) -> None:
        if path not in CACHE_PATHS:
            raise ValueError(f"TokenScorer serves {', '.join(CACHE_PATHS)}, not {path!r}")
        self._m = member
        self.path = path
        self._add_special = add_special_tokens
        self._root = root_url(member.client.base_url)
        self._ids: dict[str, list[int]] = {}
        self._whole: dict[int, bool] = {}
        self._eot_ids: dict[str, int | None] = {}
        """End-of-turn text -> its token id (llama-server), kept across rounds."""
        """Token id -> whether its text is whole characters (``forced`` only forces those)."""
        self._pending: dict[tuple[int, ...], asyncio.Future[float]] = {}
        self.draft: DraftTokens | None = None
        self.counts = counts if counts is not None else ScoreCounts()
        self._stats = member.stats if count_in_member else None
        caps = member.capabilities
        self.llama_server = path == "forced" and caps is not None and caps.tokenize == "llama.cpp"
        """The forced path on llama.cpp's ``llama-server`` (token-id prompts, native ``/completion``)."""

    def new_round(self) -> None:
        """Forget the last round's tokens (the committed answer changed)."""
        self._ids.clear()
        self._pending.clear()

    # -- tokens -------------------------------------------------------------------------------
    async def tokenize(self, text: str) -> list[int]:
        """The server's tokenization of ``text`` (as its completions endpoint reads a text prompt)."""
        known = self._ids.get(text)
        if known is not None:
            return known
        m = self._m
        if self.path != "forced":  # vLLM's /tokenize
            body = {"prompt": text, "add_special_tokens": self._add_special}
            if m.model is not None:
                body["model"] = m.model
            ids = token_list(await m.client.post(f"{self._root}/tokenize", body))
        elif self.llama_server:  # BOS where the model adds one, as a text prompt gets it; pieces
            answer = await m.client.post(
                f"{self._root}/tokenize", {"content": text, "add_special": True, "with_pieces": True}
            )
            ids = self._pieces(answer)
        else:
            ids = token_list(await m.client.post(f"{self._root}/extras/tokenize", {"input": text}))
        if len(self._ids) > 64:
            self._ids.clear()
        self._ids[text] = ids
        return ids

    def _pieces(self, answer: Any) -> list[int]:
        """The ids of a ``/tokenize`` answer ``with_pieces`` (llama-server), noting for each whether
        its piece is whole characters (text) or not (a list of bytes)."""
        entries = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(entries, list):
            raise ServerResponseError("tokenizer answer has no 'tokens' list")
        ids: list[int] = []
        for entry in entries:
            token = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(token, int) or isinstance(token, bool):
                raise ServerResponseError("tokenizer answer lists a token without an integer id")
            ids.append(token)
            self._whole[token] = isinstance(entry.get("piece"), str)
        return ids

    async def detokenize(self, ids: Sequence[int], *, retries: int | None = None) -> str:
        """llama-cpp-python's text of ``ids`` (``/extras/detokenize``; it answers 500 when the
        bytes are not whole UTF-8 characters)."""
        url = f"{self._root}/extras/detokenize"
        body = await self._m.client.request_json("POST", url, {"tokens": list(ids)}, retries=retries)
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ServerResponseError("detokenize answer has no text")
        return text

    async def whole_characters(self, ids: Sequence[int]) -> bool:
        """Whether every token of ``ids`` stands for whole characters (asked once per token)."""
        for i in dict.fromkeys(ids):
            if i not in self._whole:
                try:
                    await self.detokenize([i], retries=0)
                    self._whole[i] = True
                except HTTPMemberError as exc:
                    if exc.status != 500:
                        raise
                    self._whole[i] = False
            if not self._whole[i]:
                return False
        return True

    # -- scoring ------------------------------------------------------------------------------
    async def score(self, base: str, text: str, eot: str | None) -> tuple[float, int] | None:
        """Mean log-prob and token count of ``text`` (and the end-of-turn text ``eot``) after ``base``."""
        values = await self.token_logprobs(base, text, eot)
        if values is None:
            return None
        return sum(values) / len(values), len(values)

    async def token_logprobs(self, base: str, text: str, eot: str | None = None) -> list[float] | None:
        """The log-prob of each of ``text``'s tokens (and ``eot``'s) after ``base``, as the server
        tokenizes ``base + text``; ``None`` when this path cannot score it (see the class)."""
        if self.llama_server:
            return await self._forced_by_ids(base, text, eot)
        if self.path == "forced":
            if eot is not None or SPECIAL_TEXT.search(text):
                return None
            async with server_lock(self._root):
                base_ids, full_ids = await self.tokenize(base), await self.tokenize(base + text)
                start = common_prefix(base_ids, full_ids)
                if start >= len(full_ids):
                    return None
                forced = await self._forced(base, text, base_ids, full_ids, start)
            if forced is None:
                return None
            values = forced
        else:
            full_text = base + text + (eot or "")
            base_ids, full_ids = await asyncio.gather(self.tokenize(base), self.tokenize(full_text))
            start = common_prefix(base_ids, full_ids)
            if start >= len(full_ids):
                return None
            values = await self._ids_path(full_ids, start)
        return values

    def _from_draft(self, ids: list[int], start: int) -> list[float | None]:
        """The log-probs of ``ids[start:]`` the member's own draft already gave (same ids before)."""
        draft = self.draft
        known: list[float | None] = [None] * (len(ids) - start)
        if draft is not None:
            mine = draft.prompt_ids + draft.ids
            shared = common_prefix(mine, ids)
            for p in range(max(start, len(draft.prompt_ids)), min(shared, len(ids))):
                known[p - start] = draft.logprobs[p - len(draft.prompt_ids)]
                self.counts.from_draft += 1
        return known

    async def _ids_path(self, ids: list[int], start: int) -> list[float]:
        """The log-probs of ``ids[start:]`` on the ``prompt_tail`` or ``next_token`` path."""
        known = self._from_draft(ids, start)
        if self.path == "prompt_tail" and None in known:
            try:
                tail = await self._send_tail(ids)
            except HTTPMemberError as exc:
                # 400 "Out of range float values are not JSON compliant": a cached position's
                # unwritten value happened to be NaN or +inf, and vLLM failed writing the answer
                # (the request still ran, so the next_token requests read even more from the cache)
                if exc.status != 400:
                    raise
                self.counts.tail_fallbacks += 1
                if self._stats is not None:
                    self._stats.tail_fallbacks += 1
                tail = {}
            for p, value in tail.items():
                if p >= start and known[p - start] is None:
                    known[p - start] = value
        return await self._next_token(ids, start, known)

    async def _next_token(self, ids: list[int], start: int, known: list[float | None]) -> list[float]:
        """Fill the unknown log-probs of ``ids[start:]``, one request per token."""
        waits: list[Awaitable[float]] = []
        slots: list[int] = []
        for k, value in enumerate(known):
            if value is None:
                slots.append(k)
                waits.append(self._request_next(ids[: start + k + 1]))
        for k, value in zip(slots, await asyncio.gather(*waits), strict=True):
            known[k] = value
        return [v for v in known if v is not None]

    def _request_next(self, ids: list[int]) -> Awaitable[float]:
        """The log-prob of ``ids[-1]`` after ``ids[:-1]`` (identical requests of a round are shared)."""
        key = tuple(ids)
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._send_next(ids))
            self._pending[key] = pending
        return pending

    async def _send_next(self, ids: list[int]) -> float:
        m = self._m
        payload = m.body(
            prompt=ids[:-1],
            max_tokens=1,
            logprobs=0,
            logprob_token_ids=[ids[-1]],
            return_tokens_as_token_ids=True,
            **m.greedy_body(),
        )
        answer = await m.client.post("/completions", payload)
        self.counts.add(answer, self._stats)
        return next_token_logprob(answer, ids[-1])

    async def _send_tail(self, ids: list[int]) -> dict[int, float]:
        """Position -> log-prob of every position of ``ids`` the server computed (not read from its
        prefix cache) in one token-in-token-out request."""
        m = self._m
        payload: dict[str, Any] = {
            "token_ids": list(ids),
            "sampling_params": {
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
                "detokenize": False,  # the cached positions' ids are not real ids
                "skip_reading_prefix_cache": False,
            },
        }
        if m.model is not None:
            payload["model"] = m.model
        answer = await m.client.post(f"{self._root}/inference/v1/generate", payload)
        self.counts.add(answer, self._stats)
        return prompt_tail_logprobs(answer, ids)

    async def _eot_id(self, eot: str, bos: list[int]) -> int | None:
        """The one token id of the end-of-turn text ``eot`` (asked once per scorer: it does not
        change between rounds), or ``None`` when the server reads it as several tokens."""
        if eot not in self._eot_ids:
            ids = await self.tokenize(eot)
            if len(ids) == 2 and ids[:1] == bos:  # the BOS the tokenizer adds
                ids = ids[1:]
            self._eot_ids[eot] = ids[0] if len(ids) == 1 else None
        return self._eot_ids[eot]

    async def _forced_by_ids(self, base: str, text: str, eot: str | None) -> list[float] | None:
        """The forced path on llama-server: the prompt as token ids, the candidate forced by a
        grammar of its ids, its end of turn (``eot``) as the end of generation the matched grammar
        lets through (a logit bias picks that one among the ends of generation; the log-probs the
        server lists are the logits' before any sampling step). Tokens the member's own draft
        generated at the same place take the draft's log-probs, and only the rest is asked for.
        ``None`` where a token is not whole characters or the text holds special-token text (a
        grammar must not name an end of generation)."""
        if SPECIAL_TEXT.search(text):
            return None
        base_ids, full_ids = await asyncio.gather(self.tokenize(base), self.tokenize(base + text))
        start = common_prefix(base_ids, full_ids)
        target = full_ids[start:]
        if not target and eot is None:
            return None
        if not all(self._whole.get(i, False) for i in target):
            return None
        eot_id = await self._eot_id(eot, base_ids[:1]) if eot is not None else None
        if eot is not None:
            if eot_id is None:
                return None
            target = [*target, eot_id]
        ids = full_ids[:start] + target
        known = self._from_draft(ids, start)
        first = next((k for k, value in enumerate(known) if value is None), None)
        if first is None:
            return [v for v in known if v is not None]
        rest = ids[start + first :]
        forced = rest[:-1] if eot_id is not None else rest
        m = self._m
        payload = m.body(
            prompt=ids[: start + first],
            n_predict=len(rest),
            n_probs=1,
            grammar=token_grammar(forced) if forced else 'root ::= ""',
            cache_prompt=True,
            **m.greedy_body(),
        )
        if eot_id is not None:
            payload["logit_bias"] = [[eot_id, 100.0]]
        answer = await m.client.post(f"{self._root}/completion", payload)
        self.counts.add({"usage": native_usage(answer, start + first)}, self._stats)
        values = completion_logprobs(answer, rest)
        return [*(v for v in known[:first] if v is not None), *values]

    async def _forced(
        self, base: str, text: str, base_ids: list[int], ids: list[int], start: int
    ) -> list[float] | None:
        prompt = base
        if start < len(base_ids):  # a boundary merge: continue from the shared tokens' own text
            try:
                prompt = await self.detokenize(ids[:start], retries=0)
            except HTTPMemberError as exc:
                if exc.status != 500:  # 500: the shared tokens end inside a character
                    raise
                return None
            if not base.startswith(prompt) or await self.tokenize(prompt) != ids[:start]:
                return None
        tail = ids[start:]
        if not (base[len(prompt) :] + text).isascii() and not await self.whole_characters(tail):
            return None
        m = self._m
        payload = m.body(
            prompt=prompt,
            max_tokens=len(tail),
            logprobs=1,
            grammar=token_grammar(tail),
            stream=True,
            **m.greedy_body(),
        )
        chunks = await m.client.post("/completions", payload, events=True)
        self.counts.add({"usage": {"prompt_tokens": start}}, self._stats)
        try:
            return forced_logprobs(chunks, len(tail))
        except AlignmentError:  # cut short by another client's request: once more, not streamed
            payload["stream"] = False
            answer = await m.client.post("/completions", payload)
            self.counts.add({"usage": {"prompt_tokens": start}}, self._stats)
            return forced_logprobs([answer], len(tail))


def llama_server_draft_tokens(prompt: str, prompt_ids: list[int], choice: Any) -> DraftTokens | None:
    """The token record of a llama-server draft answer (``logprobs``: each generated token's id and
    log-prob from the logits before sampling, its end of generation included), after ``prompt``
    whose ids are ``prompt_ids``; ``None`` when the answer lacks it."""
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    rows = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(rows, list):
        return None
    ids: list[int] = []
    values: list[float] = []
    for row in rows:
        token = row.get("id") if isinstance(row, dict) else None
        value = logprob_value(row.get("logprob")) if isinstance(row, dict) else None
        if not isinstance(token, int) or isinstance(token, bool) or value is None:
            return None
        ids.append(token)
        values.append(value)
    return DraftTokens(prompt, list(prompt_ids), ids, values)


def draft_tokens(prompt: str, choice: Any) -> DraftTokens | None:
    """The token record of a vLLM draft answer (``return_token_ids`` and ``logprobs: 0``), or
    ``None`` when the answer lacks it."""
    if not isinstance(choice, dict):
        return None
    prompt_ids, ids = choice.get("prompt_token_ids"), choice.get("token_ids")
    lp = choice.get("logprobs")
    values = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if not (isinstance(prompt_ids, list) and isinstance(ids, list) and isinstance(values, list)):
        return None
    if len(values) != len(ids) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return DraftTokens(prompt, list(prompt_ids), list(ids), [float(v) for v in values])
