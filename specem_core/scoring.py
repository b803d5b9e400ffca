"""The arithmetic of a round, as pure functions: normalization, Hedge, the vote and Model Exit.

Not to be confused with :mod:`specem_core.vote`, which runs these functions on one round's score
rows, nor with the ``scoring`` option (mean logit or mean log-prob: what a verifier's score is).

Pure Python on small lists (N members × N candidates), so it is exact, cheap and testable
against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specem_core.config import HedgeDecay, NonPositiveRule, Normalization

if TYPE_CHECKING:
    from specem_core.types import Candidate


def softmax(values: Sequence[float], temperature: float = 1.0) -> list[float]:
    """Numerically stable softmax."""
    if not values:
        return []
    scaled = [v / temperature for v in values]
    top = max(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def normalize_row(
    row: Sequence[float],
    rule: Normalization,
    *,
    nonpositive_rule: NonPositiveRule = "softmax",
    temperature: float = 1.0,
) -> list[float]:
    """Normalize one verifier's scores over the candidates (paper Eq. 3).

    ``sum``: ŝ_i = m_i / Σ_k m_k. That is only meaningful when every m_i > 0 (raw logits and
    log-probs can be ≤ 0: a negative sum inverts the ranking). For such rows, ``nonpositive_rule``
    decides: ``softmax`` (our safe rule) uses a softmax over the row, which keeps the ranking and
    gives a distribution; ``raw`` divides by the sum anyway, as the authors' code does, and
    returns zeros when the sum is 0.

    ``softmax``: ŝ = softmax(m / temperature).
    """
    if not row:
        return []
    if rule == "softmax":
        return softmax(row, temperature)
    if all(v > 0 for v in row):
        total = sum(row)
        return [v / total for v in row]
    if nonpositive_rule == "softmax":
        return softmax(row, temperature)
    total = sum(row)
    if total == 0:
        return [0.0 for _ in row]
    return [v / total for v in row]


def hedge_rewards(
    normalized: Sequence[Sequence[float]],
    verifier_ids: Sequence[int],
    candidate_ids: Sequence[int],
    member_ids: Sequence[int],
) -> dict[int, float]:
    """Win-rate rewards of SpecEM's online feedback (authors' ``compute_winrate_reward``).

    ``normalized[j][i]`` is verifier ``verifier_ids[j]``'s score of the candidate drafted by
    member ``candidate_ids[i]``. For member m with a candidate c_m:

        wins_m = #{(j, k): verifier j ≠ m, candidate k not by m, ŝ[j][c_m] ≥ ŝ[j][k]}
        r_m    = max(wins_m, 1) / (|V∖{m}| · |C∖{m}|)

    which is the paper's max(wins, 1)/(N−1)² when every member drafts and verifies. Members
    without a candidate this round (verifier-only or exited) get the mean reward of those with
    one, so their weight stays neutral (our rule; the authors' code has no such members).
    Ties count as wins, as in the authors' code.

    Returns:
        reward per member id in ``member_ids``.
    """
    rewards: dict[int, float] = {}
    own_column = {m: i for i, m in enumerate(candidate_ids)}
    for m in member_ids:
        col = own_column.get(m)
        if col is None:
            continue
        judges = [j for j, v in enumerate(verifier_ids) if v != m]
        others = [k for k, c in enumerate(candidate_ids) if c != m]
        pairs = len(judges) * len(others)
        if pairs == 0:
            rewards[m] = 1.0
            continue
        wins = sum(1 for j in judges for k in others if normalized[j][col] >= normalized[j][k])
        rewards[m] = max(wins, 1) / pairs
    if rewards:
        neutral = sum(rewards.values()) / len(rewards)
        for m in member_ids:
            rewards.setdefault(m, neutral)
    else:
        rewards = dict.fromkeys(member_ids, 1.0)
    return rewards


def hedge_learning_rate(eta0: float, n_members: int, round_index: int, decay: HedgeDecay) -> float:
    """η_k = η0·sqrt(1/N)/sqrt(k) (``sqrt``, paper) or η0·sqrt(1/N)/k (``inverse``, authors' code)."""
    base = eta0 * math.sqrt(1.0 / max(n_members, 1))
    if decay == "sqrt":
        return base / math.sqrt(round_index)
    return base / round_index


def hedge_update(weights: Sequence[float], rewards: Sequence[float], eta: float) -> list[float]:
    """w ← normalize(w · exp(η r))."""
    raw = [w * math.exp(eta * r) for w, r in zip(weights, rewards, strict=True)]
    total = sum(raw)
    return [v / total for v in raw]


def combine(normalized: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """S_i = Σ_j w_j ŝ[j][i]."""
    if not normalized:
        return []
    n_cand = len(normalized[0])
    return [sum(w * row[i] for w, row in zip(weights, normalized, strict=True)) for i in range(n_cand)]


def combine_leave_self_out(
    normalized: Sequence[Sequence[float]],
    weights: Sequence[float],
    verifiers: Sequence[int],
    owners: Sequence[int],
    candidates: Sequence[Candidate],
) -> list[float]:
    """S_i = Σ_{j ∉ own(i)} w_j ŝ[j][i] / Σ_{j ∉ own(i)} w_j: no verifier votes on its own
    candidate (nor on another member's identical one). Rows stay normalized over all candidates,
    so a verifier's vote on the others is relative to how it rates its own. A candidate that only
    its own drafters could judge falls back to every verifier's vote."""
    keys = [(c.text, c.ended) for c in candidates]
    combined = []
    for n, key in enumerate(keys):
        own = {owners[k] for k, other in enumerate(keys) if other == key}
        judges = [j for j, v in enumerate(verifiers) if v not in own] or list(range(len(verifiers)))
        total = sum(weights[j] for j in judges)
        if total <= 0:
            total, judge_weights = float(len(judges)), [1.0] * len(judges)
        else:
            judge_weights = [weights[j] for j in judges]
        combined.append(sum(w * normalized[j][n] for w, j in zip(judge_weights, judges, strict=True)) / total)
    return combined


def argmax_first(values: Sequence[float]) -> int:
    """Index of the maximum; ties go to the lowest index (the authors' stable sort)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def entropy(p: Sequence[float]) -> float:
    """Shannon entropy in nats."""
    return -sum(x * math.log(x) for x in p if x > 0)


@dataclass
class ModelExit:
    """Model Exit — our design; SpecFuse published no formulas.

    Keep cumulative scores Q_i = Σ_k S_i(k) of the members still drafting, p = softmax(Q/τ).
    After ``min_rounds`` rounds, once H(p) < γ·ln(n), members with p_i < ε stop drafting (they
    keep verifying). The member with the highest p never exits, nor does ``keep`` (the member
    the caller trusts most, e.g. by a labelled calibration: votes measure likelihood, not
    correctness, and can prefer a weaker member's more predictable text).

    With ``agreement_rounds`` > 0 a member also stops once its candidate was the same text as the
    anchor's (``keep`` while it drafts, else the leader by Q) in that many consecutive rounds:
    while it agrees it changes no decision, yet each of its drafts costs compute.
    """

    temperature: float
    entropy_ratio: float
    min_prob: float
    min_rounds: int
    keep: int | None = None
    agreement_rounds: int = 0
    cumulative: dict[int, float] = field(default_factory=dict)
    agreeing: dict[int, int] = field(default_factory=dict)
    """Consecutive rounds in which each member drafted the anchor's text."""

    def update(
        self,
        round_index: int,
        drafting: Sequence[int],
        scores: dict[int, float],
        texts: Mapping[int, object] | None = None,
    ) -> list[int]:
        """Add this round's combined scores (and, for ``agreement_rounds``, each drafter's
        candidate: any comparable value, e.g. ``(text, ended)``); return the members that exit now."""
        for m in drafting:
            self.cumulative[m] = self.cumulative.get(m, 0.0) + scores.get(m, 0.0)
        if len(drafting) < 2:
            return []
        q = [self.cumulative.get(m, 0.0) for m in drafting]
        best = drafting[argmax_first(q)]
        protected = {best, self.keep}
        exits: list[int] = []
        if self.agreement_rounds > 0 and texts is not None:
            anchor = self.keep if self.keep is not None and self.keep in drafting else best
            for m in drafting:
                same = m != anchor and m in texts and anchor in texts and texts[m] == texts[anchor]
                self.agreeing[m] = self.agreeing.get(m, 0) + 1 if same else 0
                if self.agreeing[m] >= self.agreement_rounds and m not in protected:
                    exits.append(m)
        if round_index < self.min_rounds:
            return exits
        p = softmax(q, self.temperature)
        if entropy(p) >= self.entropy_ratio * math.log(len(drafting)):
            return exits
        protected.update(exits)
        return exits + [m for m, pm in zip(drafting, p, strict=True) if pm < self.min_prob and m not in protected]
