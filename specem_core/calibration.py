"""A weight prior from a small labelled calibration set: each member answers alone, and is graded.

The quality study (docs/reports/quality.md) found that the votes measure likelihood, not
correctness: weights learned from votes alone can come to trust a weaker member, and Model Exit
then stops the stronger one. What separated the members was a prior measured on labelled
examples of the task: each member's score alone, ``1 + score in %``. :func:`calibrate` measures
it, so an application can serve the ensemble the way the study did:

    >>> from specem_core import SpecEM, SpecEMConfig, load_member      # doctest: +SKIP
    >>> from specem_core.calibration import calibrate
    >>> members = [load_member("qwen2.5-coder-1.5b"), load_member("qwen2.5-coder")]
    >>> examples = [{"prompt": "What is 17 + 25? Give the number only.", "answer": "42"}, ...]
    >>> calibration = calibrate(members, examples, grade="number", max_new_tokens=64)
    >>> calibration.prior
    {'qwen2.5-coder-1.5b-instruct': 61.0, 'qwen2.5-coder-0.5b-instruct': 36.0}
    >>> engine = SpecEM(members, SpecEMConfig(normalization="softmax", model_exit=True),
    ...                 member_weights=calibration.member_weights(min_share=0.1))

Every member answers every example with plain greedy decoding (a one-member engine: its own
chat template, no votes), one member after another. An example a member fails on (an error
after the engine's retries, a prompt longer than its context window) counts as wrong for that
member and is reported in :attr:`MemberScore.errors` and the per-example records; nothing is
dropped silently.

Built-in graders (``grade=``): ``"exact"`` (equal after trimming, case folding, collapsing
white space and dropping a final period), ``"contains"`` (the expected text appears in the
reply, same normalization), ``"number"`` (the last number in the reply equals the expected
number: GSM8K-style) and ``"choice"`` (the first option letter the reply names equals the
expected one: multiple choice). Or any callable ``(reply, expected) -> bool | float`` with a
float in [0, 1] for partial credit.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from specem_core.config import SpecEMConfig
from specem_core.errors import ConfigError, InputError, SpecEMError

if TYPE_CHECKING:
    from specem_core.backends.base import Member
    from specem_core.weights import MemberWeights

Grader = Callable[[str, Any], "bool | float"]
"""``(reply, expected) -> bool | float``: 1 / True right, 0 / False wrong, in between partial credit."""

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def last_number(reply: str) -> float | None:
    """The last number in a reply ("... is $1,250." -> 1250.0); None when it names none."""
    found = _NUMBER.findall(reply)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").replace("$", ""))
    except ValueError:
        return None


def choice_letter(reply: str, labels: Sequence[str] = ("A", "B", "C", "D", "E")) -> str | None:
    """The option label a reply names ("B", "B.", "The answer is B", "(B) ..."); None when none."""
    alts = "|".join(re.escape(label) for label in labels)
    text = reply.strip()
    m = re.match(rf"^\(?({alts})\b", text)
    if m:
        return m.group(1)
    m = re.search(rf"answer(?: is|:)?\s*\(?({alts})\b", text, re.IGNORECASE)
    if m:
        return m.group(1).upper()
    m = re.search(rf"\b({alts})\b", text)
    return m.group(1) if m else None


def _normalized(text: str) -> str:
    return " ".join(str(text).split()).casefold().removesuffix(".").strip()


def _exact(reply: str, expected: Any) -> bool:
    return _normalized(reply) == _normalized(expected)


def _contains(reply: str, expected: Any) -> bool:
    target = _normalized(expected)
    return bool(target) and target in _normalized(reply)


def _number(reply: str, expected: Any) -> bool:
    value = last_number(reply)
    want = expected if isinstance(expected, int | float) and not isinstance(expected, bool) else None
    if want is None:
        want = last_number(str(expected))
        if want is None:
            raise InputError(f"grader 'number': the expected answer {expected!r} is not a number")
    return value is not None and math.isclose(value, float(want), rel_tol=0.0, abs_tol=1e-6)


def _choice(reply: str, expected: Any) -> bool:
    want = str(expected).strip().upper()
    if not want:
        raise InputError("grader 'choice': the expected answer is empty")
    labels = tuple(dict.fromkeys(("A", "B", "C", "D", "E", want)))
    return choice_letter(reply, labels) == want


GRADERS: dict[str, Grader] = {"exact": _exact, "contains": _contains, "number": _number, "choice": _choice}
"""The built-in graders by name."""


@dataclass
class MemberScore:
    """One member's result on the calibration set."""

    member: str
    """The member's name."""
    score: float
    """Mean grade in % (0–100)."""
    examples: int
    """Examples graded (every example of the set, failures included)."""
    errors: int = 0
    """Examples the member failed to answer (graded 0)."""
    seconds: float = 0.0
    """Wall time of all its answers."""


@dataclass
class Calibration:
    """Each member's score alone on a labelled set, and the weight prior made of it."""

    scores: dict[str, MemberScore]
    """Per member name, in the members' order."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """Per example and member: ``example`` (index), ``member``, ``reply``, ``grade``, ``seconds``,
    and ``error`` when it failed."""

    @property
    def prior(self) -> dict[str, float]:
        """``1 + score in %`` per member: the prior of the quality study (docs/reports/quality.md).
        The 1 keeps a member that solved nothing positive, so it still takes part (a gate,
        ``min_share``, is what keeps it out)."""
        return {name: 1.0 + s.score for name, s in self.scores.items()}

    @property
    def best(self) -> str:
        """The member with the highest score (the first one among equals)."""
        return max(self.scores.values(), key=lambda s: s.score).member

    @property
    def runner_up(self) -> str | None:
        """The member with the second-highest score (None with one member)."""
        rest = [s for s in self.scores.values() if s.member != self.best]
        return max(rest, key=lambda s: s.score).member if rest else None

    def paired(self, a: str, b: str) -> tuple[int, int, float]:
        """Examples where member ``a`` got more credit than ``b``, fewer, and the two-sided exact
        sign test's p on those (ties dropped): whether the set separates the two at all.

        A prior from a set that does not separate the best two can trust the wrong one (small
        sets ranked the quality study's members the wrong way round: docs/reports/quality.md,
        "How many calibration examples"): add examples until p is small.
        """
        for name in (a, b):
            if name not in self.scores:
                raise ConfigError(f"no member {name!r} in this calibration; members: {', '.join(self.scores)}")
        grades: dict[tuple[str, int], float] = {(r["member"], r["example"]): r["grade"] for r in self.records}
        examples = sorted({i for (_, i) in grades})
        better = sum(grades[(a, i)] > grades[(b, i)] for i in examples)
        worse = sum(grades[(a, i)] < grades[(b, i)] for i in examples)
        return better, worse, sign_test(better, worse)

    def member_weights(self, **options: float) -> MemberWeights:
        """A new :class:`~specem_core.weights.MemberWeights` with this prior (``options``:
        ``learning_rate``, ``max_log_ratio``, ``min_share``)."""
        from specem_core.weights import MemberWeights

        return MemberWeights(self.prior, **options)

    def weights(self, **options: float) -> MemberWeights:
        """Deprecated (until 0.3): :meth:`member_weights`."""
        warnings.warn(
            "Calibration.weights() is now Calibration.member_weights(); the old name stops working in 0.3",
            FutureWarning,
            stacklevel=2,
        )
        return self.member_weights(**options)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view (scores, prior and records)."""
        return {
            "scores": [asdict(s) for s in self.scores.values()],
            "prior": self.prior,
            "records": list(self.records),
        }


def sign_test(better: int, worse: int) -> float:
    """Two-sided exact sign test on the pairs that differ (ties dropped): P(as extreme | p = 1/2)."""
    n = better + worse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(better, worse) + 1)) / 2**n
    return min(1.0, 2.0 * float(tail))


def _grader(grade: str | Grader) -> Grader:
    if callable(grade):
        return grade
    if isinstance(grade, str) and grade in GRADERS:
        return GRADERS[grade]
    raise ConfigError(f"unknown grader {grade!r}; built in: {', '.join(GRADERS)} (or pass a callable)")


def _messages(example: Mapping[str, Any], index: int) -> list[dict[str, Any]] | str:
    if "messages" in example:
        messages = example["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(f"calibration example {index}: 'messages' must be a non-empty list of chat messages")
        return messages
    prompt = example.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"calibration example {index}: needs a non-empty 'prompt' string or a 'messages' list")
    return prompt


def _check(examples: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    rows = list(examples)
    if not rows:
        raise InputError("the calibration set is empty")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise InputError(f"calibration example {i}: expected a mapping, got {type(row).__name__}")
        _messages(row, i)
        if "answer" not in row:
            raise InputError(f"calibration example {i}: no 'answer' field (the expected answer)")
    return rows


def _credit(value: object, member: str, index: int) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0:
        return float(value)
    raise ConfigError(
        f"the grader returned {value!r} for member {member!r} on example {index}; expected a bool or a number in [0, 1]"
    )


def calibrate(
    members: Sequence[Member],
    examples: Iterable[Mapping[str, Any]],
    grade: str | Grader = "exact",
    *,
    config: SpecEMConfig | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    **overrides: Any,
) -> Calibration:
    """Grade each member's answers alone on a labelled set; the result's :attr:`~Calibration.prior`
    is the weight prior of the quality study.

    Args:
        members: the ensemble's members (loaded), each run alone; verify-only members
            (``can_draft=False``) cannot answer and are rejected.
        examples: mappings with ``prompt`` (a string) or ``messages`` (a chat), and ``answer``
            (what the grader compares the reply with).
        grade: a built-in grader name (``exact``, ``contains``, ``number``, ``choice``) or a
            callable ``(reply, expected) -> bool | float``.
        config: the generation settings (default: greedy, the library defaults); use the
            settings you will serve with, e.g. the same ``max_new_tokens``.
        progress: called as ``progress(member, done, total)`` after each answer.
        **overrides: any :class:`SpecEMConfig` field (e.g. ``max_new_tokens=320``).

    Raises:
        InputError: an empty set, or an example without a prompt or an answer (named by index).
        ConfigError: an unknown grader, a member that cannot draft, or a grader that returns
            something other than a bool or a number in [0, 1].
    """
    from specem_core.engine import SpecEM

    grader = _grader(grade)
    rows = _check(examples)
    members = list(members)
    if not members:
        raise ConfigError("calibration needs at least one member")
    for m in members:
        if not m.can_draft:
            raise ConfigError(f"member {m.name!r} cannot draft (verify-only), so it cannot answer alone")
    if isinstance(grade, str):  # a bad expected answer is found before any model work
        for i, row in enumerate(rows):
            try:
                grader("", row["answer"])
            except InputError as exc:
                raise InputError(f"calibration example {i}: {exc}") from None
    base = (config or SpecEMConfig()).replace(**overrides)
    scores: dict[str, MemberScore] = {}
    records: list[dict[str, Any]] = []
    for member in members:
        engine = SpecEM([member], base)
        total = 0.0
        errors = 0
        start = time.perf_counter()
        for i, row in enumerate(rows):
            began = time.perf_counter()
            record: dict[str, Any] = {"example": i, "member": member.name}
            try:
                reply = engine.generate(_messages(row, i)).text
            except SpecEMError as exc:  # retried inside the engine: counts as wrong, and is reported
                errors += 1
                record.update(reply=None, grade=0.0, error=f"{type(exc).__name__}: {exc}")
            else:
                credit = _credit(grader(reply, row["answer"]), member.name, i)
                total += credit
                record.update(reply=reply, grade=credit)
            record["seconds"] = round(time.perf_counter() - began, 3)
            records.append(record)
            if progress is not None:
                progress(member.name, i + 1, len(rows))
        scores[member.name] = MemberScore(
            member=member.name,
            score=100.0 * total / len(rows),
            examples=len(rows),
            errors=errors,
            seconds=round(time.perf_counter() - start, 3),
        )
    return Calibration(scores=scores, records=records)


def load_examples(
    path: str,
    *,
    prompt_template: str | None = None,
    answer_field: str = "answer",
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Calibration examples from a JSONL file, one example per line.

    Args:
        path: the file.
        prompt_template: builds ``prompt`` from each row's fields with :meth:`str.format`, e.g.
            ``"{question}\\nGive the final answer as a number on the last line."``; default:
            the row's own ``prompt`` (or ``messages``).
        answer_field: the field holding the expected answer (e.g. ``final``).
        limit: read at most this many examples.

    Raises:
        InputError: an unreadable file, a line that is not a JSON object, or a template field a
            row lacks (named by line).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [line for line in fh if line.strip()]
    except OSError as exc:
        raise InputError(f"cannot read calibration file {path}: {exc.strerror or exc}") from None
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines[:limit] if limit is not None else lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}, line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}, line {n}: expected a JSON object")
        example = dict(row)
        if prompt_template is not None:
            try:
                example["prompt"] = prompt_template.format(**row)
            except KeyError as exc:
                raise InputError(f"{path}, line {n}: the prompt template names field {exc}; the row has none") from None
            except (IndexError, ValueError) as exc:
                raise InputError(f"the prompt template is not a valid format string: {exc}") from None
            example.pop("messages", None)
        if answer_field not in row:
            raise InputError(f"{path}, line {n}: no {answer_field!r} field (the expected answer)")
        example["answer"] = row[answer_field]
        out.append(example)
    return out
