"""Stop strings in a growing answer: where one ends the answer, and how much of the tail to hold
back from a stream because it could still grow into one."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str], old_len: int) -> int | None:
    """Earliest index of a stop string that overlaps the newly added text."""
    best: int | None = None
    for s in stops:
        idx = text.find(s, max(0, old_len - len(s) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that could still grow into a stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if s.startswith(text[-n:]):
                hold = n
                break
    return hold
