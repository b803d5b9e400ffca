"""The copy guard (our addition to the paper's loop): a follow-up is not answered with an earlier answer.

Verifiers score likelihood, and a span copied from an earlier assistant turn is almost surely
predicted once it starts: the exact text is in the context. So where one member answers the new
question and another repeats its previous answer, both verifiers tend to prefer the repeat (the
Quality report's "Follow-ups" section measures it). With ``copy_guard_words=N``, a candidate that
makes the answer repeat a run of N words of an earlier assistant turn — a run that no other
message of the conversation holds, so quoting the user, the system prompt or a tool result is no
copy — wins only when every candidate does:

- in a voted round the winner is the best-voted candidate that copies nothing;
- a member drafting alone (``trusted_opening_rounds``) whose opening copies has the others draft
  too, and the round is voted.

When every candidate copies, ``copy_break`` keeps the answer from following them (in prose: not
inside code or math, where repeats are often right): the round commits the winner only up to the
word that would complete the copy, and the next drafts may not start with that word
(:attr:`~specem_core.backends.base.SamplingParams.avoid_words`); a winner that copies from its first
word has the round drafted again at once under that rule (twice at most). Where every redraft
copies too, the vote stands.

Words are runs of letters and digits, compared case-blind, so punctuation and spacing do not hide a
copy. A conversation without earlier assistant turns (every single-turn benchmark) is untouched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

_WORD = re.compile(r"\w+")
_FENCE = re.compile(r"```|~~~")


def words(text: str) -> list[str]:
    """The words of ``text`` as the guard compares them: runs of letters and digits, lower case."""
    return [w.lower() for w in _WORD.findall(text)]


def opens_with(text: str, avoided: Sequence[str]) -> bool:
    """Whether ``text`` (a draft so far) has one of the ``avoided`` words (lower case) as its first
    word, or a start of one that the next tokens may complete (``copy_break``)."""
    first = _WORD.search(text)
    if first is None:
        return False
    word = first.group().lower()
    if first.end() == len(text):  # the word may go on
        return any(a.startswith(word) for a in avoided)
    return word in avoided


def in_code_or_math(text: str) -> bool:
    """Whether the end of ``text`` lies inside code or math: a fenced block, an inline code span
    or a LaTeX ``\\( \\)`` / ``\\[ \\]`` span (not ``$``: prices), where repeating an earlier
    answer is often right (a program's unchanged lines, the given equations), so ``copy_break``
    does not cut there."""
    fences = _FENCE.split(text)
    if len(fences) % 2 == 0:  # an odd number of fences: inside a block
        return True
    prose = fences[-1]
    if prose.count("`") % 2:
        return True
    return prose.rfind("\\(") > prose.rfind("\\)") or prose.rfind("\\[") > prose.rfind("\\]")


def first_word_done(text: str) -> bool:
    """Whether ``text`` holds a whole first word (one followed by another character)."""
    first = _WORD.search(text)
    return first is not None and first.end() < len(text)


def _runs(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def _message_texts(message: Mapping[str, Any]) -> Iterable[str]:
    content = message.get("content")
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):  # content parts
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                yield part["text"]


class CopyGuard:
    """Which candidates would make the answer repeat an earlier assistant turn.

    Args:
        messages: the conversation the answer follows (OpenAI-style dicts).
        run_words: N, the length of a repeated run that counts as a copy; 0 turns the guard off.
    """

    def __init__(self, messages: Sequence[Mapping[str, Any]], run_words: int) -> None:
        self.run_words = run_words
        earlier: set[tuple[str, ...]] = set()
        other: set[tuple[str, ...]] = set()
        if run_words > 0:
            for message in messages:
                target = earlier if message.get("role") == "assistant" else other
                for text in _message_texts(message):
                    target |= _runs(words(text), run_words)
        self._copied = earlier - other
        """Runs of N words only an earlier assistant turn holds."""

    @property
    def active(self) -> bool:
        """Whether there is anything to guard against (the guard is on and there are earlier answers)."""
        return bool(self._copied)

    def copies(self, answer: str, candidate: str) -> bool:
        """Whether appending ``candidate`` to the committed ``answer`` makes a run of N words that
        only an earlier assistant turn holds, the run ending in the candidate's words (a copy the
        committed answer already holds is no fault of this round's candidates)."""
        return self.cut(answer, candidate) is not None

    def cut(self, answer: str, candidate: str) -> tuple[int, str] | None:
        """Where a copying ``candidate`` (see :meth:`copies`) starts to copy: the length of its
        head that copies nothing yet (up to the end of the word before the one that completes the
        first copied run) and that word; ``None`` when it copies nothing."""
        if not self._copied or not candidate:
            return None
        n = self.run_words
        before = words(answer)
        joined = answer + candidate
        spans = [(m.end(), m.group().lower()) for m in _WORD.finditer(joined)]
        after = [word for _, word in spans]
        # the first word the candidate wrote or changed (it may extend the answer's last word)
        start = len(before) - 1 if before and after[len(before) - 1] != before[-1] else len(before)
        for end in range(max(start, n - 1), len(after)):
            if tuple(after[end - n + 1 : end + 1]) in self._copied:
                head = spans[end - 1][0] - len(answer) if end > 0 else 0
                return max(head, 0), after[end]
        return None

    def flag(self, answer: str, texts: Sequence[str]) -> list[int]:
        """The indices of the ``texts`` (candidates) that copy; empty when all or none do (then
        the guard has nothing to choose between)."""
        flagged = [n for n, text in enumerate(texts) if self.copies(answer, text)]
        return [] if len(flagged) == len(texts) else flagged

    @staticmethod
    def pick(winner: int, combined: Sequence[float], copied: Sequence[int]) -> int:
        """The vote's ``winner``, or, when it copies, the best-voted candidate that does not
        (ties: the first)."""
        if winner not in copied:
            return winner
        rest = [n for n in range(len(combined)) if n not in copied]
        return max(rest, key=lambda n: (combined[n], -n)) if rest else winner
