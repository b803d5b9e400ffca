"""Replay an engine result's rounds member by member, for tests that check what a feature changed.

Each round's candidates are compared with what every drafter drafts alone, on a fresh session
that has committed the earlier rounds' text: once with the feature's sampling and once without.
A test of the feature asserts that the engine's candidates are the first and that somewhere they
differ from the second, so the test fails when the engine drafts without the feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specem_core import SamplingParams, SessionRequest
from specem_core.types import GenerationResult


@dataclass
class ReplayedDraft:
    """One drafter's candidate in one round, beside its two reference drafts."""

    round: int
    member: str
    engine: tuple[str, bool]
    """The candidate the engine's round shows for this member (``("", False)``: none)."""
    with_feature: tuple[str, bool]
    without_feature: tuple[str, bool]


def replay_drafts(
    members: Sequence[Any],
    messages: list[dict[str, str]],
    result: GenerationResult,
    *,
    segment_len: int,
    max_new_tokens: int,
    feature: SamplingParams,
    plain: SamplingParams | None = None,
) -> list[ReplayedDraft]:
    """Every drafter's draft of every round of ``result``, redone alone with ``feature`` and with
    ``plain`` sampling (default: greedy, no healing) after committing the earlier rounds' text."""
    plain = plain or SamplingParams()
    by_name = {m.name: m for m in members}
    request = SessionRequest(messages)
    out: list[ReplayedDraft] = []
    committed = ""
    for seg in result.segments:
        first = members[0].open(request)
        if committed:
            first.commit(committed, final=True)  # accounting only: the tokens the budget has left
        max_tokens = min(segment_len, max_new_tokens - first.completion_tokens)
        first.close()
        shown = {c.member: (c.text, c.ended) for c in seg.candidates}
        for name in seg.drafters:
            refs = []
            for sampling in (feature, plain):
                session = by_name[name].open(request)
                try:
                    if committed:
                        session.commit(committed)
                    d = session.draft(max_tokens, sampling)
                finally:
                    session.close()
                refs.append((d.text, d.ended))
            out.append(ReplayedDraft(seg.index, name, shown.get(name, ("", False)), refs[0], refs[1]))
        committed += seg.text
    return out
