"""Scripted members for the agent-loop tests (#45): they write exact tool calls, as bare JSON,
the way the default preset's models did in the issue's replays."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specem_core import Candidate, CandidateScore, Draft, SamplingParams, SessionRequest


def _tool(name: str, doc: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


TOOLS = [_tool("add", "Add two integers."), _tool("multiply", "Multiply two integers.")]
OPS: dict[str, Callable[[int, int], int]] = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


def bare_call(name: str, a: int, b: int) -> str:
    return json.dumps({"name": name, "arguments": {"a": a, "b": b}})


@dataclass
class Writer:
    """A member that writes ``script(request, committed)`` from where the text stands (the whole
    rest in one draft), whatever was committed before: a model that keeps writing its call."""

    name: str
    script: Callable[[SessionRequest, str], str]
    can_draft: bool = True
    can_verify: bool = True
    context_window: int | None = None
    concurrency_key: str = "writer"
    requests: list[SessionRequest] = field(default_factory=list)

    def open(self, request: SessionRequest) -> WriterSession:
        self.requests.append(request)
        return WriterSession(self, request)


class WriterSession:
    def __init__(self, member: Writer, request: SessionRequest) -> None:
        self.member, self.request, self.text = member, request, ""

    prompt_tokens = 10

    @property
    def completion_tokens(self) -> int:
        return len(self.text) // 4

    def draft(
        self, max_tokens: int, sampling: SamplingParams, *, hints: Sequence[Candidate] = (), score_eos: bool = False
    ) -> Draft:
        return Draft(self.member.script(self.request, self.text), ended=True, tokens=4)

    def score(self, candidates: Sequence[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        return [CandidateScore(mean_logit=1.0, mean_logprob=-1.0, n_tokens=1) for _ in candidates]

    def commit(self, text: str, *, final: bool = False) -> None:
        self.text += text

    def close(self) -> None:
        pass


def stubborn(request: SessionRequest, committed: str) -> str:
    """Always the multiply(12, 7) call, bare JSON, with or without tools (the issue's replay)."""
    return bare_call("multiply", 12, 7)


LOOPING_ENDS_ON_THE_LAST_RESULT = (
    "known limit (left when #63 was resolved): after add(84, 5) = 89 the member goes on with "
    "multiply(89, 5), add(445, 5), … (new calls, which reapplies_last_call does not catch) until "
    "MAX_TOOL_ROUNDS, and the answer then states the last result: 'The result is 11280.'"
)
"""Why the agent-loop tests that grade :func:`looping`'s final answer fail (strict xfails)."""


def looping(request: SessionRequest, committed: str) -> str:
    """multiply(12, 7), add(84, 5), then multiply(last, 5), add(last, 5), … forever."""
    results = [int(m["content"]) for m in request.messages if m.get("role") == "tool"]
    if not request.tools:
        return bare_call("add", results[-1], 5) if not committed else ""
    if not results:
        return bare_call("multiply", 12, 7)
    return bare_call("add" if len(results) % 2 else "multiply", results[-1], 5)
