"""Checks shared by the tests of server members on real servers (llama-cpp-python, vLLM): the fixed
rounds the cache-reading scoring paths are compared on, and a transport that keeps what each
request sent and got back."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specem_core.backends.base import SessionRequest
from specem_core.types import Candidate

CONTEXT = (
    "Company A0: founded in 1950, headquarters in Lisbon, 100 employees, makes solar panels.\n"
    "Company B1: founded in 1957, headquarters in Oslo, 237 employees, makes bicycles.\n"
    "Company C2: founded in 1964, headquarters in Nairobi, 374 employees, makes water filters.\n"
    "Company E4: founded in 1978, headquarters in Osaka, 648 employees, makes textbooks."
)
MESSAGES = [
    {"role": "system", "content": "Answer from this context only, briefly.\n\n" + CONTEXT},
    {"role": "user", "content": "Which company has its headquarters in Osaka and what does it make?"},
]
FIXED_ROUNDS: list[tuple[str, list[Candidate]]] = [
    (
        "",
        [
            Candidate("a", "Company E4 makes textbooks.", False),
            Candidate("b", "Company B1, in Oslo.", False),
            Candidate("c", "I do not know", False),
        ],
    ),
    (
        "Company E4",
        [Candidate("a", " has its headquarters in Osaka", False), Candidate("b", " makes bicycles in Oslo", False)],
    ),
    (
        "Company E4 has its headquarters in Osaka",
        [Candidate("a", " and makes textbooks.", False), Candidate("b", ".", False)],
    ),
    (
        "Company E4 has its headquarters in Osaka and makes",
        [Candidate("a", " textbooks.", False), Candidate("b", " robots.", False), Candidate("c", " text", False)],
    ),
]
"""Rounds of a short RAG conversation: the committed answer and the candidates every path scores."""


@dataclass
class PathComparison:
    """Scores of the same rounds on two paths."""

    rows: list[tuple[list[float], list[float]]]
    """(first path's mean log-probs, second path's), per round."""
    max_difference: float
    same_winners: bool
    same_token_counts: bool


def compare_paths(first: Any, second: Any, messages: list[dict[str, str]] = MESSAGES) -> PathComparison:
    """Score :data:`FIXED_ROUNDS` with two members on the same server (one session each, committing
    round by round, as the engine does)."""
    rows: list[tuple[list[float], list[float]]] = []
    worst = 0.0
    same_winners = same_counts = True
    sessions = [first.open(SessionRequest(messages)), second.open(SessionRequest(messages))]
    committed = ""
    for text, cands in FIXED_ROUNDS:
        for s in sessions:
            s.commit(text[len(committed) :])
        committed = text
        a, b = (s.score(cands, score_eos=False) for s in sessions)
        va = [float(r.mean_logprob if r.mean_logprob is not None else float("nan")) for r in a]
        vb = [float(r.mean_logprob if r.mean_logprob is not None else float("nan")) for r in b]
        rows.append((va, vb))
        worst = max([worst, *(abs(x - y) for x, y in zip(va, vb, strict=True))])
        same_winners &= va.index(max(va)) == vb.index(max(vb))
        same_counts &= [r.n_tokens for r in a] == [r.n_tokens for r in b]
    for s in sessions:
        s.close()
    return PathComparison(rows, worst, same_winners, same_counts)


class Recorder(httpx.AsyncHTTPTransport):
    """A real network transport that keeps each request's JSON body and its answer (a streamed
    answer as its list of events)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict[str, Any], Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        raw = await response.aread()
        body = json.loads(request.content) if request.content else {}
        text = raw.decode("utf-8", errors="replace")
        answer: Any
        if body.get("stream"):
            answer = [
                json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line
            ]
        else:
            try:
                answer = json.loads(text)
            except ValueError:
                answer = text
        self.calls.append((request.url.path, body, answer))
        return httpx.Response(response.status_code, headers=response.headers, content=raw, request=request)

    def scoring(self) -> list[tuple[dict[str, Any], Any]]:
        """The scoring requests (echo, forced, next-token or prompt-tail) among the calls, with
        their answers."""
        out = []
        for path, body, answer in self.calls:
            if path.endswith("/inference/v1/generate"):
                out.append((body, answer))
                continue
            if not path.endswith("/completions") or path.endswith("chat/completions"):
                continue
            if body.get("echo") or body.get("grammar") or body.get("logprob_token_ids"):
                out.append((body, answer))
        return out


def listed_positions(answer: Any) -> int:
    """How many positions an answer lists log-probs for (an echo lists every prompt position)."""
    chunks = answer if isinstance(answer, list) else [answer]
    n = 0
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            lp = choice.get("logprobs") or {}
            n += len(lp.get("token_logprobs") or lp.get("top_logprobs") or [])
    return n


PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")


def prefix_hits(log_path: Path) -> list[tuple[int, int]]:
    """(tokens read from the KV prefix, tokens evaluated) of each request a verbose llama-cpp-python
    server logged a prefix hit for, in order."""
    text = log_path.read_text(errors="replace")
    return [(int(a), int(b)) for a, b in PREFIX_HIT.findall(text)]
