"""An in-process fake OpenAI-compatible server for ``httpx.MockTransport``.

It speaks ``/v1/models``, ``/v1/completions`` (with ``echo`` + ``logprobs``) and
``/v1/chat/completions`` in the dialects that matter to SpecEM:

* ``dialect="vllm"``: echo entries for every token, specials spelled out, offsets into the text
  we sent, each log-prob aligned with its token, assistant prefill (``continue_final_message``)
  supported. ``max_tokens`` below 1 is a 400 (``max_tokens must be at least 1, got 0.``), except
  ``max_tokens=0`` with ``echo`` on ``/completions``: vLLM echoes the prompt and generates nothing
  (its usage still counts the one token it generated and dropped, as vLLM 0.x does).
* ``dialect="llama"``: a line-by-line model of llama-cpp-python 0.3.36's ``_create_completion``:
  entry ``i`` pairs token ``i`` with the distribution *after* it, unless the prompt's first token
  is BOS (then it is dropped and the pairing lines up); specials are spelled ``""`` and left out
  of ``text_offset``; ``max_tokens=0`` means unlimited; prefill is ignored.

The vLLM dialect with ``token_ids=True`` (:meth:`FakeServer.vllm` builds one) also speaks what the
``prompt_tail`` and ``next_token`` scoring paths ask for
(:mod:`specem_core.backends.http.token_scoring`), in token ids of a stable vocabulary
(:func:`token_id`, :func:`token_text`):

* ``/tokenize`` (a text ``prompt``, or ``messages`` + ``add_generation_prompt`` rendered with
  :data:`CHATML`) and ``/detokenize`` at the server root, beside ``/v1`` (not under it);
* ``/v1/completions`` with a token-id prompt, ``logprob_token_ids`` (listed in
  ``top_logprobs``, keyed ``"token_id:<id>"`` with ``return_tokens_as_token_ids``) and
  ``return_token_ids`` (``prompt_token_ids`` and ``token_ids``), and generated tokens' log-probs
  without ``echo``;
* a prefix cache in whole blocks of ``block_size`` tokens: a request reads the longest prefix of
  whole blocks an earlier request computed (never its last token), and every request's full blocks
  are cached. A request with prompt log-probs (``echo``) reads nothing from it, as vLLM skips
  reading the cache for them. ``usage.prompt_tokens_details.cached_tokens`` reports what was read
  when ``enable_prompt_tokens_details`` (vLLM's ``--enable-prompt-tokens-details``);
* ``/inference/v1/generate`` at the root (``enable_scale_out``; else vLLM's 403): token ids in,
  ``prompt_logprobs`` out, one row per prompt token: ``None`` for the first, a stale value
  (:data:`STALE`, whatever the buffer held) for each position read from the cache, the computed
  log-prob for the rest. ``tail_400_every`` / ``tail_400_when`` inject vLLM's 400 when one of those
  unwritten values is NaN or +inf (the request still ran and filled the cache); ``tail_400s`` counts
  them.

The "language model" is a table: every token costs ``weights.get(token, default)`` log-prob when
it is the real next token; any other token costs ``MISS``. With ``context_jitter`` the log-prob
also depends on where the token stands (a deterministic offset in ``[-context_jitter, 0]`` from
the number of tokens before it, the one before it and the token): the same token after the same
tokens has the same log-prob on every endpoint (echo, chat, generation, ``next_token``,
``prompt_tail``), and one scored after the wrong prefix has another. Generation follows ``answer``.
"""

from __future__ import annotations

import json
import re
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
TOKEN_RE = re.compile(r"<\|[a-z_]+\|>|[ ]?[A-Za-z]+|\d|\n|[ ]|[^\w\s]|\w")
MISS = -6.0
FILLERS = {"zzz": -3.0, "qqq": -3.5, "yyy": -4.0}
STALE = -99.0
"""The value of a ``prompt_tail`` row read from the prefix cache (never computed): a scorer that
took one would be off by nats."""
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
UNWRITABLE = "Out of range float values are not JSON compliant"


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


_VOCAB: dict[str, int] = {}
_TOKENS: list[str] = []
_VOCAB_LOCK = threading.Lock()


def token_id(token: str) -> int:
    """The fake tokenizer's id of ``token`` (specials first, then in order of first sight; the same
    in every fake server of the process)."""
    with _VOCAB_LOCK:
        found = _VOCAB.get(token)
        if found is None:
            found = _VOCAB[token] = len(_TOKENS)
            _TOKENS.append(token)
        return found


for _special in SPECIALS:
    token_id(_special)


def token_text(i: int) -> str:
    """The token of id ``i``.

    Raises:
        KeyError: no token has that id.
    """
    with _VOCAB_LOCK:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(_TOKENS):
            raise KeyError(i)
        return _TOKENS[i]


def render_messages(msgs: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The conversation as :data:`CHATML` renders it (the fake's own chat template)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class _BadRequest(Exception):
    """A request the fake answers with a 400 (``message`` in OpenAI's error shape)."""


@dataclass
class FakeServer:
    dialect: str = "vllm"
    answer: str = "The capital of France is Paris."
    weights: dict[str, float] = field(default_factory=dict)
    default: float = -0.5
    bos: str = "<|im_start|>"
    """llama dialect: the BOS token (dropped from echo when the prompt starts with it)."""
    model: str = "fake"
    owned_by: str | None = None
    top_k_cap: int | None = None
    """Answer at most this many alternatives per slot (simulates a small top-k)."""
    chat_handler: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    api_key: str | None = None
    version: str = "0.0.0+fake"
    """vllm dialect: what ``/version`` (beside ``/v1``) answers."""
    context_jitter: float = 0.0
    """How much a token's log-prob depends on where it stands (module docstring); 0: not at all."""
    # -- vLLM's token-id features (module docstring) -------------------------------------------
    token_ids: bool = False
    """vllm dialect: ``/tokenize`` and ``/detokenize``, token-id prompts, ``logprob_token_ids``,
    ``return_token_ids`` (off: those endpoints are 404s, as on a server without them)."""
    enable_scale_out: bool = False
    """``/inference/v1/generate`` served (vLLM's ``--enable-scale-out``); else a 403."""
    enable_prompt_tokens_details: bool = False
    """``usage.prompt_tokens_details.cached_tokens`` in answers (``--enable-prompt-tokens-details``)."""
    block_size: int = 16
    """Tokens per prefix-cache block: requests read the cache in whole blocks."""
    tail_400_every: int = 0
    """Answer every n-th ``/inference/v1/generate`` request (counted while this is set) with the 400 of
    an unwritable answer; 0: never."""
    tail_400_when: Callable[[list[int]], bool] | None = None
    """Answer a ``/inference/v1/generate`` request whose token ids this accepts with that 400."""
    tail_400s: int = 0
    """How many 400s ``tail_400_every`` / ``tail_400_when`` gave."""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(path, JSON body; ``{}`` for a GET) of every request but ``/v1/models``, in order."""
    _cache: set[tuple[int, ...]] = field(default_factory=set, repr=False)
    _tail_seen: int = field(default=0, repr=False)

    @classmethod
    def vllm(cls, *, scale_out: bool = True, prompt_tokens_details: bool = True, **fields: Any) -> FakeServer:
        """A vLLM with its token-id endpoints, served with ``--enable-scale-out`` and
        ``--enable-prompt-tokens-details`` (unless told otherwise), whose log-probs depend on
        where a token stands (``context_jitter`` 0.25 unless given)."""
        fields.setdefault("context_jitter", 0.25)
        return cls(
            dialect="vllm",
            token_ids=True,
            enable_scale_out=scale_out,
            enable_prompt_tokens_details=prompt_tokens_details,
            **fields,
        )

    # -- the "model" ------------------------------------------------------------------------
    def lp(self, token: str) -> float:
        if token in self.weights:
            return self.weights[token]
        if token.strip() == "" or token.strip().isdigit() or token in ",.":
            return -0.05
        return self.default

    def lp_at(self, before: Sequence[str], token: str) -> float:
        """The log-prob of ``token`` right after the tokens ``before``."""
        value = self.lp(token)
        if self.context_jitter:
            key = f"{len(before)}\x00{before[-1] if before else ''}\x00{token}".encode()
            value -= self.context_jitter * (zlib.crc32(key) % 1000) / 1000
        return value

    def row(self, target: str, before: Sequence[str] = ()) -> dict[str, float]:
        """The distribution predicting ``target`` after ``before`` (as a top list)."""
        top = dict(FILLERS)
        top[target] = self.lp_at(before, target)
        return top

    def continuation(self, prompt: str, limit: int | None) -> tuple[list[str], str]:
        for marker in ("<|im_start|>assistant\n", "### Assistant:\n"):
            idx = prompt.rfind(marker)
            if idx != -1:
                part = prompt[idx + len(marker) :]
                break
        else:
            part = ""
        counting = re.fullmatch(r"(?:\d+, )*(\d+),?", part)
        if counting:  # the probes count: "1, 2, 3," -> " 4, 5, ..."
            n = int(counting.group(1))
            rest = ("" if part.endswith(",") else ",") + "".join(f" {i}," for i in range(n + 1, n + 6))
        elif self.answer.startswith(part):
            rest = self.answer[len(part) :]
        else:
            rest = " and so on and so on and so on"
        toks = tokenize(rest)
        if limit is not None and len(toks) > limit:
            return toks[:limit], "length"
        return toks, "stop"

    # -- the prefix cache (vLLM, token-id features) ----------------------------------------------
    def cached_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` a request reads from the cache: the longest prefix of
        whole blocks cached before, the last token always computed."""
        n = 0
        size = self.block_size
        while n + size <= len(ids) - 1 and tuple(ids[: n + size]) in self._cache:
            n += size
        return n

    def remember(self, ids: Sequence[int]) -> None:
        """Cache every full block of ``ids`` (a request's prompt and generated tokens)."""
        size = self.block_size
        for end in range(size, len(ids) + 1, size):
            self._cache.add(tuple(ids[:end]))

    def forget(self) -> None:
        """Empty the prefix cache."""
        self._cache.clear()

    def _usage(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
        if self.token_ids and self.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    # -- HTTP ---------------------------------------------------------------------------------
    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"detail": "Invalid API key"})
        path = request.url.path
        if path.endswith("/models"):
            owned = self.owned_by or ("vllm" if self.dialect == "vllm" else "me")
            entry: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": owned}
            if self.dialect == "vllm":
                entry["max_model_len"] = 4096
            return httpx.Response(200, json={"object": "list", "data": [entry]})
        if request.method == "GET":
            self.calls.append((path, {}))
            if self.dialect == "vllm" and path.endswith("/version") and not path.endswith("/v1/version"):
                return httpx.Response(200, json={"version": self.version})
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        self.requests.append(body)
        self.calls.append((path, body))
        rejected = self._reject(path, body)
        if rejected is not None:
            return rejected
        try:
            if path.endswith("/chat/completions"):
                if self.chat_handler is not None:
                    return httpx.Response(200, json=self.chat_handler(body))
                return httpx.Response(200, json=self.chat(body))
            if path.endswith("/completions"):
                return httpx.Response(200, json=self.completion(body))
            if self.dialect == "vllm" and self.token_ids and not path.endswith(("/v1/tokenize", "/v1/detokenize")):
                if path.endswith("/tokenize"):
                    return httpx.Response(200, json=self.tokenize_endpoint(body))
                if path.endswith("/detokenize"):
                    return httpx.Response(200, json=self.detokenize_endpoint(body))
                if path.endswith("/inference/v1/generate"):
                    return self.generate(body)
        except _BadRequest as exc:
            return _bad_request(str(exc))
        return httpx.Response(404, json={"error": "not found"})

    def _reject(self, path: str, body: dict[str, Any]) -> httpx.Response | None:
        """vLLM's 400 for a ``max_tokens`` below 1 (its ``SamplingParams`` check); the one exception
        is ``/completions`` with ``echo`` and ``max_tokens=0`` ("echo without generation")."""
        max_tokens = body.get("max_tokens")
        if self.dialect != "vllm" or not isinstance(max_tokens, int) or max_tokens >= 1:
            return None
        if max_tokens == 0 and body.get("echo") and not path.endswith("/chat/completions"):
            return None
        message = f"max_tokens must be at least 1, got {max_tokens}."
        error = {"message": message, "type": "BadRequestError", "param": "max_tokens", "code": 400}
        return httpx.Response(400, json={"error": error})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    # -- vLLM's tokenizer endpoints and token-in-token-out endpoint ------------------------------
    def ids_of(self, text: str) -> list[int]:
        return [token_id(t) for t in tokenize(text)]

    def _tokens_of(self, ids: Any, *, empty: bool = False) -> list[str]:
        """The tokens of a list of ids (a 400 for anything else, or an id out of vocabulary)."""
        if not isinstance(ids, list) or not (ids or empty):
            raise _BadRequest("expected a non-empty list of token ids")
        try:
            return [token_text(i) for i in ids]
        except KeyError as exc:
            raise _BadRequest(f"token id {exc.args[0]!r} is out of vocabulary") from None

    def tokenize_endpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: a text ``prompt``, or ``messages`` rendered with the chat template."""
        if "messages" in body:
            text = render_messages(body["messages"], body.get("add_generation_prompt", True))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise _BadRequest("either prompt or messages is required")
        ids = self.ids_of(text)
        return {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}

    def detokenize_endpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/detokenize``."""
        return {"prompt": "".join(self._tokens_of(body.get("tokens"), empty=True))}

    def generate(self, body: dict[str, Any]) -> httpx.Response:
        """vLLM's ``/inference/v1/generate`` (``--enable-scale-out``): token ids in, prompt
        log-probs of the positions it computed out."""
        if not self.enable_scale_out:
            error = {"message": SCALE_OUT_DISABLED, "type": "PermissionDeniedError", "code": 403}
            return httpx.Response(403, json={"error": error})
        ids = body.get("token_ids")
        toks = self._tokens_of(ids)
        params = body.get("sampling_params") or {}
        k = params.get("prompt_logprobs")
        # vLLM skips reading the prefix cache for prompt log-probs unless told not to
        reads_cache = k is None or params.get("skip_reading_prefix_cache") is False
        cached = self.cached_prefix(ids) if reads_cache else 0
        gen, finish = self.continuation("".join(toks), int(params.get("max_tokens") or 16))
        gen_ids = [token_id(t) for t in gen]
        self.remember(list(ids) + gen_ids)  # the request ran, whatever its answer
        fails = self.tail_400_when is not None and self.tail_400_when(list(ids))
        if self.tail_400_every > 0:
            self._tail_seen += 1
            fails = fails or self._tail_seen % self.tail_400_every == 0
        if fails:
            self.tail_400s += 1
            return _bad_request(UNWRITABLE)
        rows: list[dict[str, Any] | None] | None = None
        if k is not None:
            detok = params.get("detokenize", True)
            rows = [None]
            for p in range(1, len(ids)):
                value = STALE if p <= cached else self.lp_at(toks[:p], toks[p])
                row = {str(ids[p]): {"logprob": value, "rank": 1, "decoded_token": toks[p] if detok else None}}
                if p > cached:
                    for rank, (alt, alt_value) in enumerate(sorted(FILLERS.items(), key=lambda kv: -kv[1])[: int(k)]):
                        row[str(token_id(alt))] = {"logprob": alt_value, "rank": rank + 2, "decoded_token": None}
                rows.append(row)
        choice = {"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": gen_ids}
        answer = {
            "request_id": f"gen-{len(self.calls)}",
            "choices": [choice],
            "prompt_logprobs": rows,
            "usage": self._usage(len(ids), len(gen_ids), cached),
        }
        return httpx.Response(200, json=answer)

    # -- completions --------------------------------------------------------------------------
    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        token_prompt = isinstance(prompt, list)
        if token_prompt:
            if not (self.dialect == "vllm" and self.token_ids):
                raise _BadRequest("the prompt must be a string")
            prompt_toks = self._tokens_of(prompt)
            prompt = "".join(prompt_toks)
        else:
            prompt_toks = tokenize(prompt)
        max_tokens = body.get("max_tokens", 16)
        limit = max_tokens if (max_tokens or self.dialect == "vllm") else None
        gen, finish = self.continuation(prompt, limit)
        stops = body.get("stop") or []
        text = "".join(gen)
        generated = len(gen)
        for n in range(1, len(gen) + 1):  # like llama.cpp: the token that completes a stop string counts
            so_far = "".join(gen[:n])
            hits = [so_far.find(s) for s in stops if s in so_far]
            if hits:
                text, finish, generated = so_far[: min(hits)], "stop", n
                gen = tokenize(text)
                break
        out: dict[str, Any] = {"text": text, "index": 0, "finish_reason": finish, "logprobs": None}
        if body.get("echo"):
            out["text"] = prompt + text
        if body.get("logprobs") is not None and body.get("echo"):
            k = int(body["logprobs"])
            out["logprobs"] = (self._echo_vllm if self.dialect == "vllm" else self._echo_llama)(prompt, gen, k)
        elif body.get("logprobs") is not None and self.dialect == "vllm" and self.token_ids:
            out["logprobs"] = self._generated_logprobs(prompt_toks, gen, body)
        if self.dialect == "vllm" and max_tokens == 0:
            generated = 1  # vLLM generates one token for an echo without generation, drops it, counts it
        usage = {"prompt_tokens": len(prompt_toks), "completion_tokens": generated}
        if self.dialect == "vllm" and self.token_ids:
            ids = [token_id(t) for t in prompt_toks]
            gen_ids = [token_id(t) for t in gen]
            # prompt log-probs (echo) are computed in a full prefill: vLLM reads nothing from its cache
            cached = 0 if body.get("echo") and body.get("logprobs") is not None else self.cached_prefix(ids)
            self.remember(ids + gen_ids)
            usage = self._usage(len(ids), generated, cached)
            if body.get("return_token_ids"):
                out["prompt_token_ids"] = ids
                out["token_ids"] = gen_ids
        return {"id": "cmpl-1", "object": "text_completion", "model": self.model, "choices": [out], "usage": usage}

    def _generated_logprobs(self, prompt_toks: list[str], gen: list[str], body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's log-probs of the generated tokens (no echo): each token's own, its top ``logprobs``
        alternatives and the tokens ``logprob_token_ids`` names."""
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        k = int(body["logprobs"])
        asked = [int(i) for i in body.get("logprob_token_ids") or []]

        def spell(token: str) -> str:
            return f"token_id:{token_id(token)}" if as_ids else token

        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        pos = 0
        for n, token in enumerate(gen):
            before = prompt_toks + gen[:n]
            value = self.lp_at(before, token)
            top = {spell(t): v for t, v in self._cap(self.row(token, before), k).items()} if k > 0 else {}
            top[spell(token)] = value
            for other in self._tokens_of(asked, empty=True):  # every token is scored as the real next one
                top[spell(other)] = self.lp_at(before, other)
            tokens.append(spell(token))
            values.append(value)
            tops.append(top)
            offsets.append(pos)
            pos += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _cap(self, top: dict[str, float], k: int) -> dict[str, float]:
        cap = self.top_k_cap if self.top_k_cap is not None else max(k, 1)
        return dict(sorted(top.items(), key=lambda kv: -kv[1])[:cap])

    def _echo_vllm(self, prompt: str, gen: list[str], k: int) -> dict[str, Any]:
        toks = tokenize(prompt) + gen
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        values: list[float | None] = [None]
        tops: list[dict[str, float] | None] = [None]
        for p in range(1, len(toks)):
            t, before = toks[p], toks[:p]
            values.append(self.lp_at(before, t))
            top = self._cap(self.row(t, before), k)
            top[t] = self.lp_at(before, t)
            tops.append(top)
        return {"tokens": toks, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echo_llama(self, prompt: str, gen: list[str], k: int) -> dict[str, Any]:
        prompt_tokens = tokenize(prompt)
        all_tokens = prompt_tokens[1 if prompt_tokens and prompt_tokens[0] == self.bos else 0 :] + gen
        # row r: the distribution after prompt_tokens[: r + 1] (llama only evaluates the prompt).
        targets = prompt_tokens[1:] + (gen[:1] or ["<|im_end|>"])
        rows = [self.row(t, prompt_tokens[: r + 1]) for r, t in enumerate(targets)]
        shown = ["" if t in SPECIALS else t for t in all_tokens]
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for idx, (token, row) in enumerate(zip(all_tokens, rows, strict=False)):
            if token == self.bos:
                continue
            offsets.append(sum(len(s) for s in shown[:idx]))
            tokens.append(shown[idx])
            value = row.get(token, MISS)
            values.append(value)
            top = self._cap(row, k)
            top[shown[idx]] = value
            tops.append(top)
        if tokens:
            values[0] = None
            tops[0] = None
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        msgs = body["messages"]
        limit = body.get("max_tokens", 16)
        prefill = (
            self.dialect == "vllm" and body.get("continue_final_message") and msgs and msgs[-1]["role"] == "assistant"
        )
        rendered = render_messages(msgs, add_generation_prompt=False)
        if prefill:
            rendered = rendered[: -len("<|im_end|>\n")]
            rendered = rendered[: rendered.rfind("<|im_start|>")] + "<|im_start|>assistant\n" + msgs[-1]["content"]
        else:
            rendered += "<|im_start|>assistant\n"
        gen, finish = self.continuation(rendered, limit)
        message = {"role": "assistant", "content": "".join(gen)}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        prompt_toks = tokenize(rendered)
        if body.get("logprobs"):
            k = int(body.get("top_logprobs") or 1)
            choice["logprobs"] = {
                "content": [
                    {
                        "token": t,
                        "logprob": self.lp_at(prompt_toks + gen[:n], t),
                        "top_logprobs": [
                            {"token": a, "logprob": v}
                            for a, v in self._cap(self.row(t, prompt_toks + gen[:n]), k).items()
                        ],
                    }
                    for n, t in enumerate(gen)
                ]
            }
        usage: dict[str, Any] = {"prompt_tokens": len(prompt_toks), "completion_tokens": len(gen)}
        if self.dialect == "vllm" and self.token_ids:
            ids = [token_id(t) for t in prompt_toks]
            cached = self.cached_prefix(ids)
            self.remember(ids + [token_id(t) for t in gen])
            usage = self._usage(len(ids), len(gen), cached)
        return {"id": "chat-1", "object": "chat.completion", "model": self.model, "choices": [choice], "usage": usage}


def _bad_request(message: str) -> httpx.Response:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    return httpx.Response(400, json={"error": error})


def chat_answer(content: str, alternatives: dict[str, float], finish: str = "length") -> dict[str, Any]:
    """A chat completion answer whose first token has these top log-probs (for judge fakes)."""
    first = max(alternatives.items(), key=lambda kv: kv[1])[0] if alternatives else content
    return {
        "id": "chat-j",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
                "logprobs": {
                    "content": [
                        {
                            "token": first,
                            "logprob": alternatives.get(first, 0.0),
                            "top_logprobs": [{"token": t, "logprob": v} for t, v in alternatives.items()],
                        }
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 1},
    }
