"""The loop's control flow: stopping, streaming, ties, Hedge trace, failures, bad input."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from scripted import ScriptedMember, ScriptedSession

from specem_core import (
    AllMembersFailedError,
    Candidate,
    CandidateScore,
    ConfigError,
    Draft,
    InputError,
    SamplingParams,
    SessionRequest,
    SpecEM,
    SpecEMConfig,
)
from specem_core.weights import MemberWeights


def _engine(*members: ScriptedMember, **cfg: object) -> SpecEM:
    return SpecEM(list(members), SpecEMConfig(**cfg))  # type: ignore[arg-type]


def test_final_word_is_kept_when_the_winner_ends() -> None:
    a = ScriptedMember("a", drafts=[("The answer", False), (" is 42", True)])
    b = ScriptedMember("b", drafts=[("Hm", False), ("", True)])
    result = _engine(a, b).generate("q")
    assert result.text == "The answer is 42"
    assert result.finish_reason == "stop"
    assert [s.winner for s in result.segments] == ["a", "a"]


def test_max_new_tokens_ends_with_length() -> None:
    a = ScriptedMember("a", drafts=[("w w w", False)])
    result = _engine(a, max_new_tokens=7).generate("q")
    assert result.finish_reason == "length"
    assert len(result.text.split()) >= 7


def test_stop_string_straddling_segments_is_cut_and_never_streamed() -> None:
    a = ScriptedMember("a", drafts=[("Thought: go\nObs", False), ("ervation: x", False), ("more", False)])
    events = list(_engine(a, stop=("Observation:",)).stream("q"))
    streamed = "".join(e.delta for e in events)
    assert streamed == "Thought: go\n"
    assert events[-1].done
    assert events[-1].result is not None
    assert events[-1].result.text == "Thought: go\n"
    assert events[-1].result.finish_reason == "stop"
    assert "Obs" not in events[0].delta  # held back: it could have been the start of the stop string


def test_one_event_per_committed_segment_and_deltas_add_up() -> None:
    a = ScriptedMember("a", drafts=[("one ", False), ("two ", False), ("three", True)])
    events = list(_engine(a).stream("q"))
    assert [e.done for e in events] == [False, False, True]
    assert [e.segment.text for e in events if e.segment] == ["one ", "two ", "three"]
    assert "".join(e.delta for e in events) == "one two three"


def test_tie_goes_to_the_lowest_member_index() -> None:
    same = lambda committed, c: 1.0  # noqa: E731
    a = ScriptedMember("a", drafts=[("A", True)], scorer=same)
    b = ScriptedMember("b", drafts=[("B", True)], scorer=same)
    assert _engine(a, b).generate("q").text == "A"
    assert _engine(b, a).generate("q").text == "B"


def test_trace_holds_matrices_weights_and_hedge() -> None:
    prefer_b = lambda committed, c: 2.0 if c.text.startswith("B") else 1.0  # noqa: E731
    members = [ScriptedMember(n, drafts=[(n.upper() + " ", False)], scorer=prefer_b) for n in "abc"]
    result = _engine(*members, max_new_tokens=6).generate("q")
    seg = result.segments[0]
    assert seg.winner == "b"
    assert [c.member for c in seg.candidates] == ["a", "b", "c"]
    assert seg.raw_scores == [[1.0, 2.0, 1.0]] * 3
    assert seg.normalized[0] == pytest.approx([0.25, 0.5, 0.25])
    assert seg.rewards == pytest.approx([0.5, 1.0, 0.5])  # b beats both others for both other judges
    assert seg.weights[1] > seg.weights[0]
    assert sum(seg.weights) == pytest.approx(1.0)
    assert seg.learning_rate == pytest.approx(0.5 / 3**0.5)
    assert result.segments[1].learning_rate == pytest.approx(0.5 / 3**0.5 / 2**0.5)


def test_hedge_off_keeps_uniform_weights() -> None:
    members = [ScriptedMember(n, drafts=[(n, False)]) for n in "abc"]
    result = _engine(*members, hedge=False, max_new_tokens=3).generate("q")
    assert all(s.weights == pytest.approx([1 / 3] * 3) for s in result.segments)
    assert all(s.rewards == [] for s in result.segments)


def test_verifier_only_member_scores_but_never_drafts() -> None:
    judge = ScriptedMember("judge", drafts=[("J", True)], can_draft=False)
    a = ScriptedMember("a", drafts=[("a ", True)])
    b = ScriptedMember("b", drafts=[("bb ", True)])
    result = _engine(a, b, judge).generate("q")
    assert "draft" not in judge.calls
    assert "score" in judge.calls
    assert result.segments[0].verifiers == ["a", "b", "judge"]
    assert result.segments[0].drafters == ["a", "b"]


def test_model_exit_reduces_members_per_round() -> None:
    prefer_a = lambda committed, c: 10.0 if c.text.startswith("a") else 1.0  # noqa: E731
    members = [ScriptedMember(n, drafts=[(n + " ", False)], scorer=prefer_a) for n in "abc"]
    cfg = dict(model_exit=True, model_exit_min_rounds=2, model_exit_temperature=0.2, max_new_tokens=10)
    result = _engine(*members, **cfg).generate("q")
    assert result.members_per_round[0] == 3
    assert result.members_per_round[-1] == 1
    assert "score" in members[2].calls  # exited members keep verifying


@pytest.mark.parametrize(
    ("keep_trusted", "prior", "b_drafts_to_the_end"),
    [
        (True, {"a": 1.0, "b": 5.0, "c": 1.0}, True),  # the member the prior trusts never exits
        (False, {"a": 1.0, "b": 5.0, "c": 1.0}, False),  # off: votes alone decide who exits
        (True, {"a": 5.0, "b": 5.0, "c": 1.0}, False),  # no single trusted member: nobody is kept
    ],
)
def test_model_exit_can_keep_the_member_the_weights_trust(
    keep_trusted: bool, prior: dict[str, float], b_drafts_to_the_end: bool
) -> None:
    prefer_a = lambda committed, c: 10.0 if c.text.startswith("a") else 1.0  # noqa: E731
    members = [ScriptedMember(n, drafts=[(n + " ", False)], scorer=prefer_a) for n in "abc"]
    cfg = SpecEMConfig(
        model_exit=True,
        model_exit_min_rounds=2,
        model_exit_temperature=0.2,
        max_new_tokens=10,
        model_exit_keeps_trusted=keep_trusted,
    )
    result = SpecEM(members, cfg, member_weights=MemberWeights(prior, learning_rate=0.0)).generate("q")
    assert result.text.startswith("a a ")  # b keeps drafting but keeps losing the vote
    assert ("b" in result.segments[-1].drafters) is b_drafts_to_the_end
    assert "c" not in result.segments[-1].drafters


@pytest.mark.parametrize(
    ("prior", "costs", "votes_favour"),
    [
        ({"a": 1.0, "b": 5.0, "c": 1.0}, (0.0, 0.0, 0.0), "a"),  # learned weights put a on top; the prior wins
        ({"a": 5.0, "b": 5.0, "c": 1.0}, (1.0, 2.0, 0.0), "a"),  # priors tie: the larger model
    ],
)
def test_model_exit_trusts_the_prior_over_weights_learned_from_votes(
    prior: dict[str, float], costs: tuple[float, float, float], votes_favour: str
) -> None:
    prefer_a = lambda committed, c: 10.0 if c.text.startswith("a") else 1.0  # noqa: E731
    members = [
        ScriptedMember(n, drafts=[(n + " ", False)], scorer=prefer_a, draft_cost=cost)
        for n, cost in zip("abc", costs, strict=True)
    ]
    weights = MemberWeights(prior)
    for _ in range(36):  # requests where a's votes always agreed with the winner
        weights.observe({n: [1.0 if n == votes_favour else 0.0] for n in "abc"})
    start = dict(zip("abc", weights.start(list("abc")), strict=True))
    assert max(start, key=start.__getitem__) == "a"  # what the votes taught
    cfg = SpecEMConfig(model_exit=True, model_exit_min_rounds=2, model_exit_temperature=0.2, max_new_tokens=10)
    result = SpecEM(members, cfg, member_weights=weights).generate("q")
    assert "b" in result.segments[-1].drafters  # kept: the prior (or the model size) trusts it
    assert "c" not in result.segments[-1].drafters


@pytest.mark.parametrize("agreement_rounds", [0, 2])
def test_model_exit_stops_a_drafter_that_keeps_agreeing_with_the_trusted_one(agreement_rounds: int) -> None:
    a, b = (ScriptedMember(n, drafts=[("x ", False)]) for n in "ab")
    c = ScriptedMember("c", drafts=[("y ", False)], scorer=lambda committed, cand: 1.0)
    cfg = SpecEMConfig(
        model_exit=True, model_exit_min_rounds=100, max_new_tokens=12, model_exit_agreement_rounds=agreement_rounds
    )
    prior = {"a": 5.0, "b": 1.0, "c": 1.0}
    result = SpecEM([a, b, c], cfg, member_weights=MemberWeights(prior, learning_rate=0.0)).generate("q")
    drafters = [seg.drafters for seg in result.segments]
    assert all("a" in d and "c" in d for d in drafters)  # the anchor never exits; c never agrees
    if agreement_rounds:
        assert [("b" in d) for d in drafters[:3]] == [True, True, False]
    else:
        assert all("b" in d for d in drafters)


@pytest.mark.parametrize(
    ("prior", "costs", "opener"),
    [
        ({"a": 1.0, "b": 5.0}, (0.0, 0.0), "b"),  # the prior names b
        ({"a": 1.0, "b": 1.0}, (0.0, 2.0), "b"),  # priors tie: the larger model
        ({"a": 1.0, "b": 1.0}, (0.0, 0.0), None),  # a tie remains: nobody is trusted, everybody drafts
        (None, (0.0, 0.0), None),  # no member weights: no effect
    ],
)
def test_trusted_opening_rounds_let_the_trusted_member_write_the_opening(
    prior: dict[str, float] | None, costs: tuple[float, float], opener: str | None
) -> None:
    prefer_a = lambda committed, c: 10.0 if c.text.startswith("a") else 1.0  # noqa: E731
    a, b = (
        ScriptedMember(n, drafts=[(n + " ", False)], scorer=prefer_a, draft_cost=c)
        for n, c in zip("ab", costs, strict=True)
    )
    weights = MemberWeights(prior, learning_rate=0.0) if prior is not None else None
    cfg = SpecEMConfig(trusted_opening_rounds=2, max_new_tokens=8, model_exit=True, model_exit_min_rounds=1)
    result = SpecEM([a, b], cfg, member_weights=weights).generate("q")
    segments = result.segments
    if opener is None:
        assert all(seg.drafters == ["a", "b"] for seg in segments[:3])
        assert segments[0].winner == "a"  # the vote, as without the option
        return
    assert [seg.drafters for seg in segments[:2]] == [[opener], [opener]]
    assert [(seg.winner, seg.verifiers, seg.raw_scores) for seg in segments[:2]] == [(opener, [], [])] * 2
    assert segments[2].drafters == ["a", "b"]  # then the ensemble as usual: the vote picks a
    assert segments[2].winner == "a"
    assert result.text.startswith("b b a ")
    assert SpecEMConfig(trusted_opening_rounds=3, reproduce_paper=True).trusted_opening_rounds == 0


@pytest.mark.parametrize(
    ("trusted_rates_a", "veto", "winner"),
    [
        (1.0, False, "a"),  # the vote alone: the weaker member's confident row carries it
        (1.0, True, "b"),  # b rates a's segment below its own draft: b's draft is committed
        (2.0, True, "a"),  # b rates it as high as its own: the vote's winner stands
    ],
)
def test_trusted_veto_commits_another_members_segment_only_when_the_trusted_member_agrees(
    trusted_rates_a: float, veto: bool, winner: str
) -> None:
    a = ScriptedMember("a", drafts=[("a ", False)], scorer=lambda committed, c: 100.0 if c.text == "a " else 1.0)
    b = ScriptedMember(
        "b", drafts=[("b ", False)], scorer=lambda committed, c: trusted_rates_a if c.text == "a " else 2.0
    )
    cfg = SpecEMConfig(trusted_veto=veto, hedge=False, max_new_tokens=1)
    result = SpecEM([a, b], cfg, member_weights=MemberWeights({"a": 1.0, "b": 1.1}, learning_rate=0.0)).generate("q")
    (segment,) = result.segments
    assert segment.winner == winner
    assert max(range(2), key=segment.combined.__getitem__) == 0  # the vote itself picked a every time
    assert SpecEMConfig(trusted_veto=True, reproduce_paper=True).trusted_veto is False


def test_trusted_veto_without_member_weights_changes_nothing() -> None:
    a = ScriptedMember("a", drafts=[("a ", False)], scorer=lambda committed, c: 100.0 if c.text == "a " else 1.0)
    b = ScriptedMember("b", drafts=[("b ", False)], scorer=lambda committed, c: 1.0 if c.text == "a " else 2.0)
    result = SpecEM([a, b], SpecEMConfig(trusted_veto=True, hedge=False, max_new_tokens=1)).generate("q")
    assert result.segments[0].winner == "a"


def test_a_failing_trusted_opener_is_excluded_and_the_others_write_the_answer() -> None:
    a = ScriptedMember("a", drafts=[("a ", False), ("done", True)])
    b = ScriptedMember("b", drafts=[("b ", False)], fail_on={"draft"})
    cfg = SpecEMConfig(trusted_opening_rounds=1, max_new_tokens=8)
    result = SpecEM([a, b], cfg, member_weights=MemberWeights({"a": 1.0, "b": 5.0})).generate("q")
    assert [(e.member, e.stage) for e in result.excluded] == [("b", "draft")]
    assert result.text == "a done"
    assert result.segments[0].drafters == ["a"]


class _AskedLengths(ScriptedMember):
    """Records the ``max_tokens`` of every draft it is asked for."""

    asked: list[int]

    def open(self, request: Any) -> ScriptedSession:
        session = super().open(request)
        draft = session.draft
        self.asked = getattr(self, "asked", [])

        def recorded(max_tokens: int, sampling: Any, **options: Any) -> Any:
            self.asked.append(max_tokens)
            return draft(max_tokens, sampling, **options)

        session.draft = recorded  # type: ignore[method-assign]
        return session


def test_a_lone_member_drafts_segments_that_double_up_to_four_times_segment_len() -> None:
    """Nothing is voted with one member: its segments are only requests (fewer, longer ones)."""
    alone = _AskedLengths("alone", drafts=[("w w w w", False)])
    result = _engine(alone, segment_len=3, max_new_tokens=40).generate("q")
    assert alone.asked[:5] == [3, 6, 12, 12, 12]
    assert alone.asked[-1] <= 12
    assert result.finish_reason == "length"


def test_members_that_vote_keep_segment_len_and_a_member_left_alone_grows() -> None:
    a = _AskedLengths("a", drafts=[("w w w", False)])
    b = ScriptedMember("b", drafts=[("v v v", False)])
    _engine(a, b, segment_len=3, max_new_tokens=18).generate("q")
    assert max(a.asked) == 3
    assert a.asked[:4] == [3, 3, 3, 3]
    survivor = _AskedLengths("survivor", drafts=[("w w w", False)])
    failing = ScriptedMember("failing", drafts=[("v v v", False)], fail_on={"score"})
    result = _engine(survivor, failing, segment_len=3, max_new_tokens=30, member_retries=0).generate("q")
    assert [e.member for e in result.excluded] == ["failing"]
    assert survivor.asked[:4] == [3, 3, 6, 12]  # the first round was drafted by both


def test_failing_drafter_is_retried_then_excluded_and_reported() -> None:
    good = ScriptedMember("good", drafts=[("fine", True)])
    bad = ScriptedMember("bad", drafts=[("x", False)], fail_on={"draft"})
    result = _engine(bad, good, member_retries=2).generate("q")
    assert result.text == "fine"
    assert bad.calls.count("draft") == 3
    assert [(e.member, e.stage) for e in result.excluded] == [("bad", "draft")]
    assert "TimeoutError" in result.excluded[0].error


def test_failing_verifier_and_open_are_excluded() -> None:
    good = ScriptedMember("good", drafts=[("ok ", False), ("done", True)])
    other = ScriptedMember("other", drafts=[("o", False)])
    bad_score = ScriptedMember("bad_score", drafts=[("zzzz", False)], fail_on={"score"})
    bad_open = ScriptedMember("bad_open", fail_on={"open"})
    result = _engine(good, other, bad_score, bad_open, member_retries=0).generate("q")
    assert {(e.member, e.stage) for e in result.excluded} == {("bad_score", "score"), ("bad_open", "open")}
    assert result.text.endswith("done")


def test_every_drafter_failing_raises_with_reasons() -> None:
    slow = ScriptedMember("slow", drafts=[("x", False)], fail_on={"draft"})  # TimeoutError: slow timed out
    gone = ScriptedMember(
        "gone", drafts=[("y", False)], fail_on={"draft"}, errors={"draft": ConnectionError("connection reset")}
    )
    broken = ScriptedMember("broken", fail_on={"open"}, errors={"open": OSError("no such model file")})
    judge = ScriptedMember("judge", can_draft=False)  # a healthy verifier: it cannot answer alone
    with pytest.raises(AllMembersFailedError) as info:
        _engine(slow, gone, broken, judge, member_retries=0).generate("q")
    message = str(info.value)
    assert message.startswith("every drafting member failed: ")
    reasons = message.removeprefix("every drafting member failed: ").split("; ")
    assert sorted(reasons) == [
        "broken (open): OSError: no such model file",
        "gone (draft): ConnectionError: connection reset",
        "slow (draft): TimeoutError: slow timed out",
    ]
    assert "judge" not in message
    assert slow.calls.count("draft") == gone.calls.count("draft") == 1  # member_retries=0


def test_a_member_failing_at_commit_is_excluded_and_the_others_finish() -> None:
    prefer_a = lambda committed, c: 10.0 if c.text.startswith("a") else 1.0  # noqa: E731
    a = ScriptedMember("a", drafts=[("a1 ", False), ("a2 ", False), ("a3", True)], scorer=prefer_a)
    b = ScriptedMember("b", drafts=[("b1 ", False), ("b2 ", False), ("b3", True)], scorer=prefer_a)
    c = ScriptedMember(
        "c",
        drafts=[("c1 ", False)],
        scorer=prefer_a,
        fail_on={"commit"},
        errors={"commit": KeyError("kv cache slot lost")},
    )
    result = _engine(a, b, c, member_retries=1).generate("q")
    assert result.text == "a1 a2 a3"  # the answer completes from the others
    assert result.finish_reason == "stop"
    assert [(e.member, e.stage, e.round) for e in result.excluded] == [("c", "commit", 1)]
    assert result.excluded[0].error == "KeyError: 'kv cache slot lost'"
    assert c.calls.count("commit") == 2  # tried, retried once, then excluded
    assert c.calls.count("draft") == 1  # ... and never asked again in this request
    assert c.calls.count("score") == 1
    assert c.calls[-1] == "close"  # its session was closed when it was excluded
    assert result.segments[0].drafters == ["a", "b", "c"]
    assert [seg.drafters for seg in result.segments[1:]] == [["a", "b"], ["a", "b"]]
    assert [seg.verifiers for seg in result.segments[1:]] == [["a", "b"], ["a", "b"]]
    assert result.members_per_round == [3, 2, 2]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        ("", "empty"),
        ([{"role": "user", "content": "   "}], "empty"),
        ([{"role": "wizard", "content": "hi"}], "unknown role"),
        ([{"role": "user", "content": [{"type": "image"}]}], "only text"),
        (["hi"], "mapping"),
        (42, "list"),
    ],
)
def test_bad_messages_raise_input_error(messages: object, match: str) -> None:
    engine = _engine(ScriptedMember("a", drafts=[("x", True)]))
    with pytest.raises(InputError, match=match):
        engine.generate(messages)  # type: ignore[arg-type]


def test_bad_ensembles_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="at least one member"):
        SpecEM([])
    with pytest.raises(ConfigError, match="unique"):
        SpecEM([ScriptedMember("a"), ScriptedMember("a")])
    with pytest.raises(ConfigError, match="no member can draft"):
        SpecEM([ScriptedMember("a", can_draft=False)])
    with pytest.raises(ConfigError, match="segment_len"):
        SpecEM([ScriptedMember("a")], segment_len=0)
    with pytest.raises(ConfigError, match="unknown SpecEM option"):
        _engine(ScriptedMember("a", drafts=[("x", True)])).generate("q", segmentlen=3)


def test_caller_messages_are_not_mutated() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    _engine(ScriptedMember("a", drafts=[("x", True)])).generate(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_usage_counts_the_final_segment() -> None:
    a = ScriptedMember("a", drafts=[("one two ", False), ("three", True)])
    result = _engine(a).generate("hello world")
    assert result.usage.completion_tokens == 3
    assert result.usage.prompt_tokens == 2
    assert result.usage.total_tokens == 5
    assert result.usage.per_member[0].drafted_tokens == 3


async def test_async_generate_and_stream_match_sync() -> None:
    def members() -> list[ScriptedMember]:
        return [ScriptedMember("a", drafts=[("x ", False), ("y", True)])]

    sync = SpecEM(members()).generate("q")
    got = await SpecEM(members()).agenerate("q")
    assert got.text == sync.text
    deltas = [e.delta async for e in SpecEM(members()).astream("q")]
    assert "".join(deltas) == sync.text


async def test_astream_cancellation_stops_the_run() -> None:
    gate = threading.Event()  # the second round's draft waits here until the consumer has gone
    closed = threading.Event()  # set when the run closes its session: it ended

    class GatedSession(ScriptedSession):
        def draft(self, max_tokens: int, sampling: SamplingParams, **kwargs: Any) -> Draft:
            if self.round >= 1:
                assert gate.wait(30)
            return super().draft(max_tokens, sampling, **kwargs)

        def close(self) -> None:
            super().close()
            closed.set()

    class GatedMember(ScriptedMember):
        def open(self, request: SessionRequest) -> ScriptedSession:
            self.calls.append("open")
            return GatedSession(self, request)

    a = GatedMember("a", drafts=[("w ", False)])  # never ends by itself: 10,000 rounds
    engine = SpecEM([a], SpecEMConfig(max_new_tokens=10_000))
    agen = engine.astream("q")
    first = await agen.__anext__()
    assert first.delta == "w "
    await agen.aclose()
    gate.set()  # the draft in flight returns: the run must see it was cancelled, not go on
    assert await asyncio.to_thread(closed.wait, 30), "the run never closed its session"
    assert a.calls.count("draft") <= 2  # the first round, and the one in flight when it was cancelled
    assert a.calls[-1] == "close"


class _JudgeSession:
    """A judge-style verifier: a distribution over the (unique) candidates it is shown."""

    def __init__(self, favourite: str) -> None:
        self.favourite = favourite
        self.shown: list[int] = []

    prompt_tokens = 1
    completion_tokens = 0

    def score(self, candidates: list[Candidate], *, score_eos: bool) -> list[CandidateScore]:
        self.shown.append(len(candidates))
        hits = [c.text == self.favourite for c in candidates]
        return [CandidateScore(probability=(0.6 if h else 0.4 / max(len(candidates) - 1, 1))) for h in hits]

    def commit(self, text: str, *, final: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


class _Judge:
    name = "judge"
    can_draft = False
    can_verify = True
    context_window = None
    concurrency_key = "judge"

    def __init__(self, favourite: str) -> None:
        self.session = _JudgeSession(favourite)

    def open(self, request: object) -> _JudgeSession:
        return self.session


def test_judge_rows_share_mass_between_identical_candidates() -> None:
    a = ScriptedMember("a", drafts=[("same", True)], can_verify=False)
    b = ScriptedMember("b", drafts=[("same", True)], can_verify=False)
    c = ScriptedMember("c", drafts=[("other", True)], can_verify=False)
    judge = _Judge("other")
    result = SpecEM([a, b, c, judge]).generate("q")  # type: ignore[list-item]
    seg = result.segments[0]
    assert judge.session.shown == [2]  # identical candidates are scored once
    assert seg.normalized[0] == pytest.approx([0.2, 0.2, 0.6])
    assert sum(seg.normalized[0]) == pytest.approx(1.0)
    assert result.text == "other"


def test_rows_without_raw_logits_fall_back_to_log_probs() -> None:
    class LogprobOnly(ScriptedMember):
        def open(self, request: SessionRequest) -> ScriptedSession:
            session = super().open(request)
            session.score = lambda cands, score_eos: [  # type: ignore[method-assign]
                CandidateScore(mean_logit=None, mean_logprob=-float(len(c.text)), n_tokens=1) for c in cands
            ]
            return session

    m = LogprobOnly("lp", drafts=[("short", True)])
    other = ScriptedMember("o", drafts=[("much longer", True)], can_verify=False)
    result = SpecEM([m, other]).generate("q")
    seg = result.segments[0]
    assert seg.raw_scores == [[-5.0, -11.0]]
    assert seg.normalized[0][0] > seg.normalized[0][1]  # softmax over log-probs keeps the ranking


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("small_first", [False, True])
def test_prompt_too_long_for_one_member_fails_before_any_model_work(parallel: bool, small_first: bool) -> None:
    """Every session is opened (render, encode, window check: no forward pass) before any member
    drafts, so a prompt that fits one member but not another is rejected before the first member
    spends minutes prefilling it."""
    import tiny

    from specem_core import ContextWindowError
    from specem_core.backends.transformers import TransformersMember

    big = tiny.member("llama", name="big")  # 512 positions
    model, tok = tiny.tiny_qwen2(max_position_embeddings=64)
    small = TransformersMember(model, tok, name="small")
    msgs = [{"role": "user", "content": "The capital of France is Paris. " * 12}]
    request = SessionRequest(msgs)
    assert len(small.encode_prompt(request)) + 2 > 64
    assert len(big.encode_prompt(request)) + 2 <= 512  # fits the other member
    forwards = {"big": 0, "small": 0}
    hooks = [
        m.model.register_forward_pre_hook(lambda *_, name=m.name: forwards.__setitem__(name, forwards[name] + 1))
        for m in (big, small)
    ]
    opened: list[object] = []
    real_open = big.open
    big.open = lambda req: opened.append(real_open(req)) or opened[-1]  # type: ignore[method-assign]
    members = [small, big] if small_first else [big, small]
    try:
        with pytest.raises(ContextWindowError, match="'small', whose context window is 64"):
            SpecEM(members, SpecEMConfig(parallel=parallel, member_retries=2)).generate(msgs)
        assert forwards == {"big": 0, "small": 0}
        assert len(opened) == 1  # an input error is not retried
        assert opened[0]._cache is None  # type: ignore[attr-defined]  # the session that did open is closed
        # the same prompt on the member it fits: the prefill happens with the first draft
        result = SpecEM([big], SpecEMConfig(max_new_tokens=3)).generate(msgs)
        assert result.usage.prompt_tokens == len(big.encode_prompt(request))
        assert forwards["big"] >= 1
    finally:
        for h in hooks:
            h.remove()


def test_drafters_on_one_device_take_turns_cheapest_first_with_the_earlier_drafts_as_hints() -> None:
    big = ScriptedMember("big", drafts=[("one two", False), (" three", True)], draft_cost=10.0)
    small = ScriptedMember("small", drafts=[("uno dos", False), (" tres", True)], draft_cost=1.0)
    result = SpecEM([big, small], SpecEMConfig(segment_len=4)).generate("count")
    assert [c.member for c in result.segments[0].candidates] == ["big", "small"]  # member order kept
    assert small.hints_seen[0] == []  # the cheaper member drafts first, shown nothing
    assert big.hints_seen[0] == ["uno dos"]
    SpecEM([big, small], SpecEMConfig(segment_len=4, reuse_other_drafts=False)).generate("count")
    assert big.hints_seen[-1] == []
    assert small.hints_seen[-1] == []
    remote = ScriptedMember("remote", drafts=[("x", True)], concurrency_key="server-b")
    SpecEM([big, remote], SpecEMConfig(segment_len=4)).generate("count")
    assert big.hints_seen[-1] == []  # different devices draft at the same time: no hints


@pytest.mark.parametrize(
    ("boundary", "first"),
    [("line", "def f():\n    "), ("tokens", "def f():\n    return 1\n")],
)
def test_line_segments_cut_a_draft_after_its_first_line_end(boundary: str, first: str) -> None:
    """``segment_boundary="line"``: a drafter that runs past a line end (e.g. an HTTP member) is
    cut after the newline and the indentation that follows it; its turn does not end there."""
    a = ScriptedMember("a", drafts=[("def f():\n    return 1\n", True), ("return 1\n", True)])
    result = _engine(a, segment_boundary=boundary).generate("q")
    assert result.segments[0].text == first
    assert result.segments[0].candidates[0].ended is (boundary == "tokens")
    assert result.text == ("def f():\n    return 1\n" if boundary == "line" else first)
    assert result.finish_reason == "stop"


def test_line_segments_keep_a_draft_without_a_line_end_or_ending_at_one() -> None:
    a = ScriptedMember("a", drafts=[("x = 1", False), (" + 2\n\n", True)])
    b = ScriptedMember("b", drafts=[("y", False)], can_draft=False)
    result = _engine(a, b, segment_boundary="line").generate("q")
    assert [s.text for s in result.segments] == ["x = 1", " + 2\n\n"]
    with pytest.raises(ConfigError, match="segment_boundary"):
        SpecEMConfig(segment_boundary="lines")  # type: ignore[arg-type]
