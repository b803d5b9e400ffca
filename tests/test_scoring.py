"""Normalization, Hedge and the vote against hand-computed values."""

from __future__ import annotations

import math

import pytest

from specem_core.scoring import (
    ModelExit,
    argmax_first,
    combine,
    entropy,
    hedge_learning_rate,
    hedge_rewards,
    hedge_update,
    normalize_row,
    softmax,
)


def test_sum_normalization_of_positive_row() -> None:
    assert normalize_row([2.0, 1.0, 1.0], "sum") == pytest.approx([0.5, 0.25, 0.25])


def test_sum_normalization_falls_back_to_softmax_on_nonpositive_row() -> None:
    row = [-1.0, 2.0, 1.0]
    got = normalize_row(row, "sum")
    assert got == pytest.approx(softmax(row))
    assert sum(got) == pytest.approx(1.0)
    assert argmax_first(got) == 1  # ranking kept; a plain division by the sum (2.0) would also rank 1 first
    negative = [-3.0, -1.0, -2.0]  # log-probs: division by the sum would invert the ranking
    assert argmax_first(normalize_row(negative, "sum")) == 1
    assert argmax_first([v / sum(negative) for v in negative]) == 0  # the defect the rule avoids


def test_raw_rule_reproduces_the_authors_division() -> None:
    assert normalize_row([-1.0, 2.0, 1.0], "sum", nonpositive_rule="raw") == pytest.approx([-0.5, 1.0, 0.5])
    assert normalize_row([1.0, -1.0], "sum", nonpositive_rule="raw") == [0.0, 0.0]


def test_softmax_normalization_with_temperature() -> None:
    got = normalize_row([1.0, 0.0], "softmax", temperature=0.5)
    assert got[0] == pytest.approx(math.exp(2) / (math.exp(2) + 1))


def test_hedge_rewards_n2_are_always_one() -> None:
    s = [[0.6, 0.4], [0.3, 0.7]]
    assert hedge_rewards(s, [0, 1], [0, 1], [0, 1]) == {0: 1.0, 1: 1.0}
    s = [[0.9, 0.1], [0.8, 0.2]]
    assert hedge_rewards(s, [0, 1], [0, 1], [0, 1]) == {0: 1.0, 1: 1.0}


def test_hedge_rewards_n3_hand_computed() -> None:
    s = [[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.4, 0.4, 0.2]]
    # wins_0: j=1 -> 0; j=2 -> 0.4>=0.4 (tie counts), 0.4>=0.2 -> 2  => 2/4
    # wins_1: j=0 -> 0.3>=0.2 -> 1; j=2 -> 2                           => 3/4
    # wins_2: j=0 -> 0; j=1 -> 0.3>=0.2 -> 1                            => 1/4
    assert hedge_rewards(s, [0, 1, 2], [0, 1, 2], [0, 1, 2]) == pytest.approx({0: 0.5, 1: 0.75, 2: 0.25})


def test_hedge_rewards_n4_hand_computed() -> None:
    s = [
        [0.4, 0.3, 0.2, 0.1],
        [0.1, 0.4, 0.3, 0.2],
        [0.25, 0.25, 0.25, 0.25],
        [0.1, 0.2, 0.3, 0.4],
    ]
    got = hedge_rewards(s, [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3])
    assert got == pytest.approx({0: 3 / 9, 1: 6 / 9, 2: 5 / 9, 3: 4 / 9})


def test_hedge_reward_floor_is_one_win() -> None:
    s = [[0.1, 0.9, 0.9], [0.1, 0.9, 0.9], [0.1, 0.9, 0.9]]
    assert hedge_rewards(s, [0, 1, 2], [0, 1, 2], [0, 1, 2])[0] == pytest.approx(1 / 4)


def test_verifier_without_candidate_gets_the_mean_reward() -> None:
    s = [[0.7, 0.3], [0.6, 0.4], [0.2, 0.8]]  # members 0, 1 draft; member 2 only verifies
    got = hedge_rewards(s, [0, 1, 2], [0, 1], [0, 1, 2])
    # wins_0: judges 1, 2; other candidate 1: 0.6>=0.4 yes, 0.2>=0.8 no -> 1 / (2*1)
    # wins_1: judges 0, 2: 0.3>=0.7 no, 0.8>=0.2 yes -> 1 / 2
    assert got == pytest.approx({0: 0.5, 1: 0.5, 2: 0.5})


@pytest.mark.parametrize(
    ("n", "k", "decay", "expected"),
    [
        (3, 1, "sqrt", 0.5 / math.sqrt(3)),
        (3, 4, "sqrt", 0.5 / math.sqrt(3) / 2),
        (3, 4, "inverse", 0.5 / math.sqrt(3) / 4),
        (2, 9, "sqrt", 0.5 / math.sqrt(2) / 3),
        (4, 2, "inverse", 0.5 / 2 / 2),
    ],
)
def test_learning_rate(n: int, k: int, decay: str, expected: float) -> None:
    assert hedge_learning_rate(0.5, n, k, decay) == pytest.approx(expected)  # type: ignore[arg-type]


def test_authors_trace_learning_rates() -> None:
    # Reference study, appendix A: N=3, lr=5 -> eta = 0.2887, 0.1443, 0.0962, 0.0722
    got = [hedge_learning_rate(0.5, 3, k, "inverse") for k in (1, 2, 3, 4)]
    assert got == pytest.approx([0.2887, 0.1443, 0.0962, 0.0722], abs=1e-4)


def test_hedge_update_hand_computed() -> None:
    eta = 0.5 / math.sqrt(3)
    w = hedge_update([1 / 3, 1 / 3, 1 / 3], [0.5, 0.75, 0.25], eta)
    # exp(0.14434)=1.155274, exp(0.21651)=1.241731, exp(0.07217)=1.074837; sum 3.471842
    assert w == pytest.approx([1.155274 / 3.471842, 1.241731 / 3.471842, 1.074837 / 3.471842], abs=1e-6)
    assert sum(w) == pytest.approx(1.0)


def test_combine_and_ties_go_to_lowest_index() -> None:
    s = [[0.5, 0.5], [0.2, 0.8]]
    assert combine(s, [0.5, 0.5]) == pytest.approx([0.35, 0.65])
    assert argmax_first([0.4, 0.4, 0.2]) == 0
    assert argmax_first([0.1, 0.4, 0.4]) == 1


def test_model_exit_drops_a_consistent_loser_only_after_min_rounds() -> None:
    rule = ModelExit(temperature=0.25, entropy_ratio=0.8, min_prob=0.1, min_rounds=3)
    scores = {0: 0.8, 1: 0.15, 2: 0.05}
    assert rule.update(1, [0, 1, 2], scores) == []
    assert rule.update(2, [0, 1, 2], scores) == []
    out = rule.update(3, [0, 1, 2], scores)
    assert 0 not in out
    assert 2 in out


def test_model_exit_never_drops_the_member_it_is_told_to_keep() -> None:
    rule = ModelExit(temperature=0.25, entropy_ratio=0.8, min_prob=0.1, min_rounds=1, keep=2)
    assert rule.update(1, [0, 1, 2], {0: 0.8, 1: 0.15, 2: 0.05}) == [1]


def test_model_exit_keeps_members_while_uncertain() -> None:
    rule = ModelExit(temperature=1.0, entropy_ratio=0.5, min_prob=0.1, min_rounds=1)
    assert rule.update(5, [0, 1], {0: 0.5, 1: 0.5}) == []
    assert entropy([0.5, 0.5]) == pytest.approx(math.log(2))


def test_model_exit_stops_a_member_that_keeps_drafting_the_anchors_text() -> None:
    rule = ModelExit(temperature=1.0, entropy_ratio=0.0, min_prob=0.1, min_rounds=100, keep=0, agreement_rounds=2)
    even = {0: 0.5, 1: 0.5, 2: 0.5}
    same, other = ("a", False), ("b", False)
    assert rule.update(1, [0, 1, 2], even, {0: same, 1: same, 2: other}) == []
    # member 2 agreed once, member 1 twice running: only member 1 exits, and never the anchor
    assert rule.update(2, [0, 1, 2], even, {0: same, 1: same, 2: same}) == [1]
    # a round of disagreement restarts the count
    assert rule.update(3, [0, 2], even, {0: same, 2: other}) == []
    assert rule.update(4, [0, 2], even, {0: same, 2: same}) == []
    assert rule.update(5, [0, 2], even, {0: same, 2: same}) == [2]


def test_model_exit_agreement_is_off_by_default_and_anchors_on_the_leader_without_keep() -> None:
    texts = {0: "x", 1: "x"}
    off = ModelExit(temperature=1.0, entropy_ratio=0.0, min_prob=0.1, min_rounds=100)
    assert [off.update(k, [0, 1], {0: 0.5, 1: 0.5}, texts) for k in (1, 2, 3)] == [[], [], []]
    rule = ModelExit(temperature=1.0, entropy_ratio=0.0, min_prob=0.1, min_rounds=100, agreement_rounds=1)
    # member 1 leads by votes, so member 0 (agreeing with it) is the one that exits
    assert rule.update(1, [0, 1], {0: 0.4, 1: 0.6}, texts) == [0]
