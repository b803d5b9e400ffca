"""A round's candidates before the vote: cut at the first line end (``segment_boundary="line"``)
and kept to what a constraint accepts (a tool call, a JSON answer: :mod:`specem_core.tools`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from specem_core.types import Candidate


class _Constraint(Protocol):
    """What :func:`constrain` needs of a constraint: a
    :class:`specem_core.tools.constraints.Constraint` (this module sits beside the tools package
    and does not import it); the engine wraps any other filter in one."""

    def __call__(self, committed: str, candidate: str, /) -> bool: ...
    def trim(self, committed: str, candidate: str) -> str: ...
    def options(self, committed: str) -> list[str]: ...


def constrain(
    constraint: _Constraint,
    committed: str,
    owners: list[int],
    candidates: list[Candidate],
    vote: Callable[[list[str]], str] | None = None,
) -> tuple[list[int], list[Candidate]]:
    """Keep the candidates the constraint accepts; when it rejects all of them, cut each back to
    its longest accepted prefix (``constraint.trim``; ``""`` when it cannot); when nothing is left,
    take one of the continuations it lists (``constraint.options``: the only one, or the one the
    verifiers ``vote`` for), as a candidate of member ``"constraint"``; else keep them all."""
    keep = [n for n, c in enumerate(candidates) if constraint(committed, c.text)]
    if keep:
        return [owners[n] for n in keep], [candidates[n] for n in keep]
    cut = [(n, constraint.trim(committed, c.text)) for n, c in enumerate(candidates)]
    cut = [(n, t) for n, t in cut if t]
    if cut:
        return [owners[n] for n, _ in cut], [
            Candidate(candidates[n].member, t, False, candidates[n].tokens) for n, t in cut
        ]
    choices = [o for o in constraint.options(committed) if o]
    if choices:
        text = choices[0] if len(choices) == 1 or vote is None else vote(choices)
        return owners[:1], [Candidate("constraint", text, False, 0)]
    return owners, candidates


def to_line_end(candidate: Candidate) -> Candidate:
    """``candidate`` up to its first line end: the newline and the whitespace right after it
    (``segment_boundary="line"``; drafters stop there themselves, HTTP members may not)."""
    text = candidate.text
    end = text.find("\n") + 1
    if end == 0:
        return candidate
    while end < len(text) and text[end].isspace():
        end += 1
    if end == len(text):
        return candidate
    return Candidate(candidate.member, text[:end], False, candidate.tokens)
