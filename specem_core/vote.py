"""One round's vote (SPEC §1, steps 3-5), on :mod:`specem_core.scoring`'s arithmetic: rows in, winner out.

The engine gathers the rows (``MemberSession.score`` on each distinct candidate); this module turns
them into per-candidate rows (:func:`score_rows`: raw scores, normalized rows), updates the
verifier weights with Hedge and combines the rows into the vote (:func:`tally`). The arithmetic
itself is :mod:`specem_core.scoring`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specem_core.config import SpecEMConfig
from specem_core.errors import SpecEMError
from specem_core.scoring import (
    argmax_first,
    combine,
    combine_leave_self_out,
    hedge_learning_rate,
    hedge_rewards,
    hedge_update,
    normalize_row,
)
from specem_core.types import Candidate, CandidateScore


def distinct(candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[int], list[int]]:
    """The candidates each verifier scores (one per distinct ``(text, ended)``), how many of the
    round's candidates each stands for, and which of them each candidate is."""
    unique: dict[tuple[str, bool], int] = {}
    for c in candidates:
        unique.setdefault((c.text, c.ended), len(unique))
    scored = [Candidate("", t, e) for (t, e) in unique]
    copies = [sum(1 for c in candidates if (c.text, c.ended) == key) for key in unique]
    return scored, copies, [unique[(c.text, c.ended)] for c in candidates]


def score_rows(
    rows: Sequence[Sequence[CandidateScore]], copies: Sequence[int], index: Sequence[int], config: SpecEMConfig
) -> tuple[list[list[float]], list[list[float]]]:
    """Each verifier's row over the distinct candidates (:func:`distinct`) as raw scores and a
    normalized row over the round's candidates. A judge's probability mass is shared by identical
    candidates, and its row is already a distribution; other rows are normalized as configured."""
    raw: list[list[float]] = []
    normalized: list[list[float]] = []
    for row in rows:
        values_unique, is_distribution = row_values(row, config.scoring)
        if is_distribution:
            values_unique = [v / n for v, n in zip(values_unique, copies, strict=True)]
        values = [values_unique[u] for u in index]
        raw.append(values)
        normalized.append(
            values
            if is_distribution
            else normalize_row(
                values,
                config.normalization,
                nonpositive_rule=config.nonpositive_rule,
                temperature=config.normalization_temperature,
            )
        )
    return raw, normalized


@dataclass
class Vote:
    """The outcome of one round's vote."""

    winner: int
    """Index of the winning candidate."""
    combined: list[float]
    """S_i of every candidate."""
    row_weights: list[float]
    """The weight of each verifier's row in the vote."""
    weights: dict[int, float]
    """Verifier weights after this round's Hedge update (by member index), for the next round."""
    rewards: list[float] = field(default_factory=list)
    """Hedge rewards per verifier (empty when Hedge is off)."""
    learning_rate: float = 0.0
    """η_k of this round (0 when Hedge is off)."""


def tally(
    normalized: Sequence[Sequence[float]],
    verifiers: Sequence[int],
    owners: Sequence[int],
    candidates: Sequence[Candidate],
    weights: Mapping[int, float],
    config: SpecEMConfig,
    round_index: int,
    *,
    learned: bool,
) -> Vote:
    """Hedge-update the verifier weights and combine the rows into the vote; without rows (a
    single candidate, no verifier) the first candidate wins.

    Args:
        normalized: one normalized row per verifier, over the candidates.
        verifiers, owners: member indices of the rows and of the candidates' drafters.
        weights: the verifier weights before this round.
        learned: the weights come from member weights learned across requests (they count even
            when Hedge is off).
    """
    weights = dict(weights)
    if not normalized:
        row_weights = [weights.get(i, 0.0) for i in verifiers] if verifiers else []
        return Vote(0, [1.0] + [0.0] * (len(candidates) - 1), row_weights, weights)
    rewards_list: list[float] = []
    eta = 0.0
    if config.hedge:
        rewards = hedge_rewards(normalized, verifiers, owners, verifiers)
        eta = hedge_learning_rate(config.hedge_eta0, len(verifiers), round_index, config.hedge_decay)
        current = [weights.get(i, 0.0) for i in verifiers]
        if sum(current) <= 0:
            current = [1.0] * len(verifiers)
        updated = hedge_update(current, [rewards[i] for i in verifiers], eta)
        weights = dict(zip(verifiers, updated, strict=True))
        rewards_list = [rewards[i] for i in verifiers]
    row_weights = [weights.get(i, 1.0 / len(verifiers)) for i in verifiers]
    if not config.hedge and not learned:
        row_weights = [1.0 / len(verifiers)] * len(verifiers)
    if config.leave_self_out:
        combined = combine_leave_self_out(normalized, row_weights, verifiers, owners, candidates)
    else:
        combined = combine(normalized, row_weights)
    return Vote(argmax_first(combined), combined, row_weights, weights, rewards_list, eta)


def row_values(row: Sequence[CandidateScore], scoring: str) -> tuple[list[float], bool]:
    """Pick the configured raw score from each candidate score.

    Judges give a distribution (``probability``). Servers expose log-probs but no raw logits, so a
    row without ``mean_logit`` falls back to ``mean_logprob`` (then normalized as configured).
    """
    if row and all(s.probability is not None for s in row):
        return [float(s.probability or 0.0) for s in row], True
    for attr in ("mean_logit", "mean_logprob") if scoring == "mean_logit" else ("mean_logprob",):
        values = [getattr(s, attr) for s in row]
        if all(v is not None for v in values):
            return [float(v) for v in values], False
    raise SpecEMError(f"a verifier returned no {scoring} score")
