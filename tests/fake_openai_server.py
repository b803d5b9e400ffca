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

The "language model" is a table: every token costs ``weights.get(token, default)`` log-prob when
it is the real next token; any other token costs ``MISS``. Generation follows ``answer``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


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

    # -- the "model" ------------------------------------------------------------------------
    def lp(self, token: str) -> float:
        if token in self.weights:
            return self.weights[token]
        if token.strip() == "" or token.strip().isdigit() or token in ",.":
            return -0.05
        return self.default

    def row(self, target: str) -> dict[str, float]:
        """The distribution predicting ``target`` (as a top list)."""
        top = dict(FILLERS)
        top[target] = self.lp(target)
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
        body = json.loads(request.content)
        self.requests.append(body)
        rejected = self._reject(path, body)
        if rejected is not None:
            return rejected
        if path.endswith("/chat/completions"):
            if self.chat_handler is not None:
                return httpx.Response(200, json=self.chat_handler(body))
            return httpx.Response(200, json=self.chat(body))
        if path.endswith("/completions"):
            return httpx.Response(200, json=self.completion(body))
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

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
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
        if self.dialect == "vllm" and max_tokens == 0:
            generated = 1  # vLLM generates one token for an echo without generation, drops it, counts it
        usage = {"prompt_tokens": len(tokenize(prompt)), "completion_tokens": generated}
        return {"id": "cmpl-1", "object": "text_completion", "model": self.model, "choices": [out], "usage": usage}

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
        for t in toks[1:]:
            values.append(self.lp(t))
            top = self._cap(self.row(t), k)
            top[t] = self.lp(t)
            tops.append(top)
        return {"tokens": toks, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echo_llama(self, prompt: str, gen: list[str], k: int) -> dict[str, Any]:
        prompt_tokens = tokenize(prompt)
        all_tokens = prompt_tokens[1 if prompt_tokens and prompt_tokens[0] == self.bos else 0 :] + gen
        # row r: the distribution after prompt_tokens[: r + 1] (llama only evaluates the prompt).
        targets = prompt_tokens[1:] + (gen[:1] or ["<|im_end|>"])
        rows = [self.row(t) for t in targets]
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
        rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        if prefill:
            rendered = rendered[: -len("<|im_end|>\n")]
            rendered = rendered[: rendered.rfind("<|im_start|>")] + "<|im_start|>assistant\n" + msgs[-1]["content"]
        else:
            rendered += "<|im_start|>assistant\n"
        gen, finish = self.continuation(rendered, limit)
        message = {"role": "assistant", "content": "".join(gen)}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if body.get("logprobs"):
            k = int(body.get("top_logprobs") or 1)
            choice["logprobs"] = {
                "content": [
                    {
                        "token": t,
                        "logprob": self.lp(t),
                        "top_logprobs": [{"token": a, "logprob": v} for a, v in self._cap(self.row(t), k).items()],
                    }
                    for t in gen
                ]
            }
        usage = {"prompt_tokens": len(tokenize(rendered)), "completion_tokens": len(gen)}
        return {"id": "chat-1", "object": "chat.completion", "model": self.model, "choices": [choice], "usage": usage}


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
