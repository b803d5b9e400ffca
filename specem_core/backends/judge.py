"""Compatibility re-exports: the API judge now lives in :mod:`specem_core.backends.http.judge`.

Existing ``from specem_core.backends.judge import …`` imports keep working.
"""

from specem_core.backends.http.judge import (
    CANDIDATE_BLOCK,
    ENDS_NOTE,
    JUDGE_SYSTEM,
    JUDGE_USER,
    LABELS,
    APIJudgeMember,
    JudgeOptions,
    addresses_judge,
    judge_messages,
    judge_orders,
    judge_scores,
    label_probabilities,
)

__all__ = [
    "CANDIDATE_BLOCK",
    "ENDS_NOTE",
    "JUDGE_SYSTEM",
    "JUDGE_USER",
    "LABELS",
    "APIJudgeMember",
    "JudgeOptions",
    "addresses_judge",
    "judge_messages",
    "judge_orders",
    "judge_scores",
    "label_probabilities",
]
