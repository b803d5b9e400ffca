"""Member weights learned across requests (specem_core/weights.py) and leave-self-out votes."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
from scripted import ScriptedMember

from specem_core import Candidate, ConfigError, SpecEM, SpecEMConfig
from specem_core.scoring import combine_leave_self_out
from specem_core.weights import MemberWeights


def test_prior_is_normalized_over_the_request_verifiers_and_unknown_members_get_the_mean() -> None:
    w = MemberWeights({"big": 3.0, "small": 1.0})
    assert w.start(["big", "small"]) == pytest.approx([0.75, 0.25])
    assert w.start(["small", "new"]) == pytest.approx([1 / 3, 2 / 3])  # "new" gets the mean prior, 2
    assert MemberWeights().start(["a", "b", "c"]) == pytest.approx([1 / 3] * 3)
    assert (w.prior_of("big"), w.prior_of("new"), MemberWeights().prior_of("a")) == (3.0, 2.0, 1.0)


def test_equal_rewards_teach_nothing_and_better_rewards_move_weight() -> None:
    w = MemberWeights(learning_rate=1.0)
    w.observe({"a": [0.5, 0.5], "b": [0.5]})
    assert w.requests == 1
    assert w.start(["a", "b"]) == pytest.approx([0.5, 0.5])
    w.observe({"a": [1.0, 1.0], "b": [0.0, 0.5]})  # centred means: a +0.375, b -0.375
    expected = 1 / (1 + math.exp(-2 * 0.375 / math.sqrt(2)))
    assert w.start(["a", "b"]) == pytest.approx([expected, 1 - expected])
    w.observe({"a": [1.0]})  # one member alone: nothing was compared
    assert w.requests == 2


def test_learning_is_bounded_and_a_zero_rate_keeps_the_prior() -> None:
    w = MemberWeights(learning_rate=100.0, max_log_ratio=1.0)
    for _ in range(5):
        w.observe({"a": [1.0], "b": [0.0]})
    a, b = w.start(["a", "b"])
    assert a / b == pytest.approx(math.exp(2.0))  # each side clipped at ±1
    fixed = MemberWeights({"a": 1.0, "b": 4.0}, learning_rate=0.0)
    fixed.observe({"a": [1.0], "b": [0.0]})
    assert fixed.start(["a", "b"]) == pytest.approx([0.2, 0.8])


def test_settled_after_reports_when_weights_stop_moving() -> None:
    w = MemberWeights()
    assert w.settled_after() is None
    for _ in range(30):
        w.observe({"a": [0.8], "b": [0.2]})
    n = w.settled_after(tolerance=0.02)
    assert n is not None
    assert 2 <= n < 30
    assert abs(w.history[n - 1]["a"] - w.history[-1]["a"]) <= 0.02
    assert abs(w.history[n - 2]["a"] - w.history[-1]["a"]) > 0.02


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    w = MemberWeights({"a": 2.0}, learning_rate=0.7)
    w.observe({"a": [1.0], "b": [0.25]})
    path = tmp_path / "weights.json"
    w.save(path)
    back = MemberWeights.load(path)
    assert back.to_dict() == w.to_dict()
    assert back.start(["a", "b"]) == pytest.approx(w.start(["a", "b"]))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "not found"),
        ("{not json", "cannot read"),
        ('{"format": "other"}', "not a SpecEM member-weights file"),
        ('{"format": "specem-member-weights/1", "prior": {"a": -1}}', "positive finite"),
        ('{"format": "specem-member-weights/1", "cumulative": {"a": "x"}}', "malformed"),
        ('{"format": "specem-member-weights/1", "requests": -3}', "malformed"),
    ],
)
def test_bad_weight_files_raise_config_error(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "w.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        MemberWeights.load(path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prior": {"a": 0.0}}, "positive finite"),
        ({"prior": {"a": float("nan")}}, "positive finite"),
        ({"prior": {"": 1.0}}, "keyed by member name"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"max_log_ratio": True}, "max_log_ratio"),
        ({"min_share": 1.0}, "min_share"),
        ({"min_share": -0.1}, "min_share"),
        ({"min_share": float("nan")}, "min_share"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MemberWeights(**kwargs)  # type: ignore[arg-type]


def test_concurrent_requests_all_count() -> None:
    w = MemberWeights()

    def work() -> None:
        for _ in range(200):
            w.observe({"a": [1.0], "b": [0.0]})
            w.start(["a", "b"])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert w.requests == 800
    assert len(w.history) == 800


# -- on the engine ---------------------------------------------------------------------------
def _trio(scorer_bias: dict[str, str]) -> list[ScriptedMember]:
    """Three members; each scores the candidate starting with the letter it is told to like at 3, others at 1."""

    def scorer_for(liked: str):  # type: ignore[no-untyped-def]
        return lambda committed, c: 3.0 if c.text.startswith(liked) else 1.0

    return [ScriptedMember(n, drafts=[(n.upper() + " ", False)], scorer=scorer_for(scorer_bias[n])) for n in "abc"]


def test_requests_start_from_learned_weights_and_teach_them() -> None:
    members = _trio({"a": "A", "b": "A", "c": "C"})  # a and c prefer their own; b likes a's candidate
    weights = MemberWeights({"a": 1.0, "b": 1.0, "c": 1.0})
    engine = SpecEM(members, SpecEMConfig(max_new_tokens=4), member_weights=weights)
    assert engine.member_weights is weights
    first = engine.generate("q")
    assert first.segments[0].weights != pytest.approx([1 / 3] * 3)  # the paper's update still runs within a request
    assert weights.requests == 1
    learned = weights.current()
    assert learned["a"] > learned["b"]  # a's candidate won b's and its own... others rated it higher
    second = engine.generate("q")
    # the second request's first round starts from the learned weights, then takes one Hedge step
    assert second.segments[0].weights[0] > first.segments[0].weights[0]
    assert weights.requests == 2


def test_faithful_requests_neither_read_nor_update_learned_weights() -> None:
    members = _trio({"a": "A", "b": "A", "c": "C"})
    weights = MemberWeights({"a": 10.0, "b": 1.0, "c": 1.0})
    engine = SpecEM(members, SpecEMConfig(max_new_tokens=4), member_weights=weights)
    paper = engine.generate("q", reproduce_paper=True)
    reference = SpecEM(_trio({"a": "A", "b": "A", "c": "C"}), SpecEMConfig(max_new_tokens=4, reproduce_paper=True))
    assert [s.weights for s in paper.segments] == [s.weights for s in reference.generate("q").segments]
    assert weights.requests == 0


def test_prior_decides_the_vote_with_hedge_off(tmp_path: Path) -> None:
    members = _trio({"a": "A", "b": "B", "c": "C"})  # pure self-preference: uniform weights tie -> a
    path = tmp_path / "w.json"
    MemberWeights({"a": 1.0, "b": 1.0, "c": 4.0}, learning_rate=0.0).save(path)
    engine = SpecEM(members, SpecEMConfig(max_new_tokens=2, hedge=False), member_weights=str(path))
    result = engine.generate("q")
    assert result.segments[0].winner == "c"
    assert result.segments[0].weights == pytest.approx([1 / 6, 1 / 6, 4 / 6])
    uniform = SpecEM(_trio({"a": "A", "b": "B", "c": "C"}), max_new_tokens=2, hedge=False).generate("q")
    assert uniform.segments[0].winner == "a"


def test_a_weights_path_is_created_then_kept_up_to_date(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    engine = SpecEM(_trio({"a": "A", "b": "A", "c": "C"}), SpecEMConfig(max_new_tokens=4), member_weights=path)
    assert json.loads(path.read_text())["requests"] == 0  # created at once
    engine.generate("q")
    engine.generate("q")
    assert json.loads(path.read_text())["requests"] == 2
    again = SpecEM(_trio({"a": "A", "b": "A", "c": "C"}), SpecEMConfig(max_new_tokens=4), member_weights=path)
    assert again.member_weights is not None
    assert again.member_weights.requests == 2
    assert again.member_weights.current() == pytest.approx(engine.member_weights.current())  # type: ignore[union-attr]
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a SpecEM member-weights file"):
        SpecEM(_trio({"a": "A", "b": "B", "c": "C"}), member_weights=path)
    with pytest.raises(ConfigError, match="cannot write member-weights file"):
        SpecEM(_trio({"a": "A", "b": "B", "c": "C"}), member_weights=tmp_path / "no" / "such" / "dir.json")


def test_a_member_below_min_share_sits_the_request_out_and_the_rest_decide_as_without_it() -> None:
    # c is everyone's second choice: with it, its candidate wins as a compromise (a and b each
    # prefer their own); gated, the request is exactly the pair {a, b}.
    likes = {
        "a": {"A": 10.0, "B": 1.0, "C": 6.0},
        "b": {"A": 1.0, "B": 10.0, "C": 6.0},
        "c": {"A": 1.0, "B": 1.0, "C": 10.0},
    }

    def trio() -> list[ScriptedMember]:
        return [
            ScriptedMember(n, drafts=[(n.upper(), True)], scorer=lambda committed, cand, n=n: likes[n][cand.text])
            for n in "abc"
        ]

    prior = {"a": 10.0, "b": 9.0, "c": 1.0}  # shares 0.50 / 0.45 / 0.05
    open_trio = SpecEM(trio(), max_new_tokens=2, hedge=False, member_weights=MemberWeights(prior, learning_rate=0.0))
    assert open_trio.generate("q").text == "C"
    members = trio()
    gated = SpecEM(
        members, max_new_tokens=2, hedge=False, member_weights=MemberWeights(prior, learning_rate=0.0, min_share=0.1)
    )
    result = gated.generate("q")
    assert members[2].calls == []  # never opened: no drafting, no scoring
    assert [(e.member, e.stage, e.round) for e in result.excluded] == [("c", "gate", 0)]
    assert "0.0500 is below min_share 0.1" in result.excluded[0].error
    pair = SpecEM(trio()[:2], max_new_tokens=2, hedge=False, member_weights=MemberWeights(prior, learning_rate=0.0))
    expected = pair.generate("q")
    assert result.text == expected.text == "A"
    assert [s.weights for s in result.segments] == [s.weights for s in expected.segments]
    assert result.to_dict()["excluded"][0]["stage"] == "gate"


def test_the_best_weighted_drafter_is_never_gated() -> None:
    drafter = ScriptedMember("small", drafts=[("x", True)])
    judge = ScriptedMember("judge", can_draft=False)
    weights = MemberWeights({"small": 1.0, "judge": 99.0}, min_share=0.5)
    result = SpecEM([drafter, judge], max_new_tokens=2, member_weights=weights).generate("q")
    assert result.text == "x"
    assert result.excluded == []


def test_a_gated_member_sleeps_and_min_share_and_counts_are_saved(tmp_path: Path) -> None:
    w = MemberWeights(min_share=0.1)
    for _ in range(9):
        w.observe({"a": [1.0], "b": [1.0], "c": [0.0]})  # c loses every comparison
    share = w.gated(["a", "b", "c"])["c"]
    assert share == pytest.approx(math.exp(-3) / (2 + math.exp(-3)))  # log-weights apart by 9 * 1 / sqrt(9)
    assert w.gated(["a", "c"]) == {"c": pytest.approx(w.start(["a", "c"])[1])}
    assert w.gated(["c"]) == {}  # a lone verifier has the whole weight
    for _ in range(100):  # requests it sat out: its own term stays at -6 / sqrt(9); a's and b's fade
        w.observe({"a": [1.0], "b": [1.0]})
    ab = math.exp(3 / math.sqrt(109))
    assert w.gated(["a", "b", "c"])["c"] == pytest.approx(math.exp(-2) / (2 * ab + math.exp(-2)))
    assert w.counts == {"a": 109, "b": 109, "c": 9}
    w.save(tmp_path / "w.json")
    again = MemberWeights.load(tmp_path / "w.json")
    assert (again.min_share, again.counts) == (0.1, w.counts)
    assert "min_share=0.1" in repr(w)
    assert MemberWeights().gated(["a", "b"]) == {}  # off by default
    old = json.loads((tmp_path / "w.json").read_text())
    del old["counts"], old["min_share"]  # a state saved before either existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = MemberWeights.load(tmp_path / "old.json")
    assert legacy.counts == {"a": 109, "b": 109, "c": 109}
    assert legacy.min_share == 0.0


# -- leave-self-out ----------------------------------------------------------------------------
def test_leave_self_out_combination_by_hand() -> None:
    cands = [Candidate("a", "A", False), Candidate("b", "B", False), Candidate("c", "A", False)]
    normalized = [[0.6, 0.3, 0.6], [0.5, 0.4, 0.5], [0.2, 0.7, 0.2]]  # verifiers a, b, c (members 0, 1, 2)
    weights = [0.5, 0.25, 0.25]
    combined = combine_leave_self_out(normalized, weights, [0, 1, 2], [0, 1, 2], cands)
    # "A" was drafted by a and c: only b judges it. "B": a and c judge it.
    assert combined == pytest.approx([0.5, (0.5 * 0.3 + 0.25 * 0.7) / 0.75, 0.5])


def test_leave_self_out_lets_the_others_decide() -> None:
    # a loves its own draft; the others' second choice is C. Rows normalize to
    # a [.714 .071 .214], b [.204 .408 .388], c [.25 .25 .5]: with self-votes A sums highest
    # (1.168 vs C 1.102); without them C (.301) beats A (.227) and B (.161).
    likes = {
        "a": {"A": 10.0, "B": 1.0, "C": 3.0},
        "b": {"A": 1.0, "B": 2.0, "C": 1.9},
        "c": {"A": 1.0, "B": 1.0, "C": 2.0},
    }
    members = [
        ScriptedMember(n, drafts=[(n.upper(), True)], scorer=lambda committed, cand, n=n: likes[n][cand.text])
        for n in "abc"
    ]
    keep = SpecEM(members, max_new_tokens=2, hedge=False).generate("q")
    leave = SpecEM(members, max_new_tokens=2, hedge=False, leave_self_out=True).generate("q")
    assert keep.text == "A"
    assert leave.text == "C"
    with pytest.raises(ConfigError, match="leave_self_out"):
        SpecEMConfig(leave_self_out="never")  # type: ignore[arg-type]
    assert SpecEMConfig(leave_self_out=True, reproduce_paper=True).leave_self_out is False


def test_weights_file_written_by_an_engine_is_plain_json(tmp_path: Path) -> None:
    weights = MemberWeights()
    engine = SpecEM(_trio({"a": "A", "b": "A", "c": "C"}), SpecEMConfig(max_new_tokens=4), member_weights=weights)
    engine.generate("q")
    weights.save(tmp_path / "w.json")
    data = json.loads((tmp_path / "w.json").read_text())
    assert data["format"] == "specem-member-weights/1"
    assert data["requests"] == 1
    assert set(data["cumulative"]) == {"a", "b", "c"}


def test_the_old_names_of_member_weights_still_work_with_a_warning() -> None:
    """``weights=`` (0.1) is ``member_weights=`` now, on the engine, ``from_preset``/``plan`` and
    the results that make them; the old names work until 0.3, with a warning naming the new one."""
    from specem_core import SpecEM
    from specem_core.calibration import Calibration, MemberScore
    from specem_core.errors import ConfigError
    from specem_core.presets import get_preset, plan

    members = _trio({"a": "A", "b": "A", "c": "C"})
    state = MemberWeights({"a": 2.0, "b": 1.0, "c": 1.0})
    with pytest.warns(FutureWarning, match="'weights' is now called 'member_weights'"):
        engine = SpecEM(members, member_retries=0, weights=state)
    assert engine.member_weights is state
    with pytest.warns(FutureWarning, match="SpecEM.member_weights"):
        assert engine.weights is state
    with pytest.raises(ConfigError, match="member_weights given twice"), pytest.warns(FutureWarning):
        SpecEM(members, weights=state, member_weights=state)
    with pytest.warns(FutureWarning, match="'weights' is now called 'member_weights'"):
        assert plan("fast", weights=False).member_weights is None
    with pytest.warns(FutureWarning, match="member_weights"):
        assert get_preset("quality").weights() is not None
    result = Calibration({"a": MemberScore("a", 50.0, 2), "b": MemberScore("b", 0.0, 2)})
    with pytest.warns(FutureWarning, match="member_weights"):
        assert result.weights().prior == result.member_weights().prior
