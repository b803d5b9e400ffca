"""The copy guard (``specem_core.copies``, ``copy_guard_words``): a follow-up is not answered with
an earlier answer when a member answers the new question."""

from __future__ import annotations

import pytest
from scripted import ScriptedMember

from specem_core import ConfigError, SpecEM, SpecEMConfig
from specem_core.copies import CopyGuard, words

EARLIER = "The pump of Press 3 was replaced by Ana on Monday morning."
CHAT = [
    {"role": "system", "content": "Answer questions about the report."},
    {"role": "user", "content": "What happened to Press 3?"},
    {"role": "assistant", "content": EARLIER},
    {"role": "user", "content": "How long did the repair take?"},
]
COPY = "The pump of Press 3 was replaced"
NEW = "The repair took four hours."


def test_words_are_compared_case_and_punctuation_blind() -> None:
    assert words("The PUMP, of  Press-3!") == ["the", "pump", "of", "press", "3"]


def test_a_run_only_an_earlier_answer_holds_is_a_copy() -> None:
    guard = CopyGuard(CHAT, 5)
    assert guard.active
    assert guard.copies("", COPY)
    assert guard.copies("", COPY.upper().replace(" ", "  "))
    assert not guard.copies("", NEW)
    assert not guard.copies("", "The pump of Press")  # four words: shorter than the run


def test_a_run_the_user_or_the_system_wrote_is_no_copy() -> None:
    quoted = [*CHAT[:3], {"role": "user", "content": "Was the pump of Press 3 replaced by Ana?"}]
    guard = CopyGuard(quoted, 5)
    assert not guard.copies("", "Yes, the pump of Press 3")  # "the pump of press 3" is the user's
    assert guard.copies("Yes, the pump of Press 3", " was replaced by Ana on")


def test_the_run_may_start_in_the_committed_answer_but_must_end_in_the_candidate() -> None:
    guard = CopyGuard(CHAT, 5)
    assert guard.copies("The pump of", " Press 3 took")  # "the pump of press 3" ends in the candidate
    assert guard.copies("The pump of Pre", "ss 3 took")  # a candidate that finishes the answer's last word
    assert not guard.copies("The pump of Press 3 was", " fixed in four hours")  # the copy was committed before


def test_without_earlier_answers_or_with_zero_the_guard_is_off() -> None:
    assert not CopyGuard(CHAT[:2], 5).active
    assert not CopyGuard(CHAT, 0).active
    assert not CopyGuard(CHAT, 0).copies("", COPY)


def test_flag_lists_the_copies_only_when_some_candidate_does_not_copy() -> None:
    guard = CopyGuard(CHAT, 5)
    assert guard.flag("", [COPY, NEW]) == [0]
    assert guard.flag("", [COPY, COPY + " on"]) == []
    assert CopyGuard.pick(0, [0.6, 0.4], [0]) == 1
    assert CopyGuard.pick(1, [0.6, 0.4], [0]) == 1
    assert CopyGuard.pick(0, [0.5, 0.3, 0.2], [0]) == 1  # the best-voted of the rest


def members() -> list[ScriptedMember]:
    """``a`` repeats its earlier answer, ``b`` answers the new question; both verifiers prefer the
    repeat, as the Quality report measured real ones do."""
    prefer_copy = lambda committed, c: 3.0 if c.text.startswith("The pump") else 1.0  # noqa: E731
    return [
        ScriptedMember("a", drafts=[(COPY, False), (" by Ana on Monday morning.", True)], scorer=prefer_copy),
        ScriptedMember("b", drafts=[(NEW, True)], scorer=prefer_copy),
    ]


def test_the_vote_picks_the_copy_and_the_guard_picks_the_answer() -> None:
    unguarded = SpecEM(members(), copy_guard_words=0).generate(CHAT)
    assert unguarded.text == EARLIER
    assert unguarded.segments[0].copied == []
    guarded = SpecEM(members()).generate(CHAT)  # on by default
    assert guarded.text == NEW
    first = guarded.segments[0]
    assert first.copied == [0]
    assert first.winner == "b"
    assert first.combined[0] > first.combined[1]  # the vote itself is unchanged: the guard overrode it
    assert guarded.trace()["segments"][0]["copied"] == [0]


def test_when_every_member_repeats_itself_the_vote_stands() -> None:
    both = members()
    both[1].drafts = [(COPY + " by", False), (" Ana on Monday morning.", True)]
    result = SpecEM(both, copy_guard_words=5).generate(CHAT)
    assert result.text.startswith(COPY)
    assert result.segments[0].copied == []


def test_a_single_turn_request_is_untouched() -> None:
    question = [{"role": "user", "content": "What happened to Press 3?"}]
    guarded = SpecEM(members(), copy_guard_words=5).generate(question)
    assert guarded.text == SpecEM(members(), copy_guard_words=0).generate(question).text
    assert all(s.copied == [] for s in guarded.segments)


def test_a_trusted_opening_that_copies_has_the_others_draft_and_a_vote() -> None:
    options = {"trusted_opening_rounds": 1, "trusted_member": "a"}
    alone = SpecEM(members(), copy_guard_words=0, **options).generate(CHAT)
    assert alone.segments[0].drafters == ["a"]
    assert alone.text == EARLIER
    guarded = SpecEM(members(), copy_guard_words=5, **options).generate(CHAT)
    assert guarded.segments[0].drafters == ["a", "b"]
    assert guarded.text == NEW


def test_a_drafter_model_exit_stopped_drafts_again_when_the_lone_draft_copies() -> None:
    """Model Exit stops ``b`` after it agreed with ``a`` once; when ``a``, drafting alone, then
    repeats its earlier answer, ``b`` drafts that round again and the guard has an answer to pick."""
    prefer_copy = lambda committed, c: 3.0 if c.text.startswith(" The pump") else 1.0  # noqa: E731
    opening = "Here is what I found:"
    pair = [
        ScriptedMember("a", drafts=[(opening, False), (" " + COPY, False), (" by Ana.", True)], scorer=prefer_copy),
        ScriptedMember("b", drafts=[(opening, False), (" " + NEW, True)], scorer=prefer_copy),
    ]
    options = {"model_exit": True, "model_exit_agreement_rounds": 1}
    result = SpecEM(pair, copy_guard_words=5, **options).generate(CHAT)
    assert [s.drafters for s in result.segments] == [["a", "b"], ["a", "b"]]
    assert result.text == f"{opening} {NEW}"
    assert result.segments[1].copied == [0]
    unguarded = SpecEM([ScriptedMember(m.name, m.drafts, m.scorer) for m in pair], copy_guard_words=0, **options)
    assert [s.drafters for s in unguarded.generate(CHAT).segments][1] == ["a"]  # b had exited


def test_tool_calls_are_not_guarded() -> None:
    call = '{"name": "lookup", "arguments": {"machine": "Press 3", "field": "repair hours"}}'
    chat = [
        {"role": "user", "content": "Look up Press 3."},
        {"role": "assistant", "content": call},
        {"role": "user", "content": "Result: 4. Now look it up again."},
    ]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    prefer_call = lambda committed, c: 3.0 if c.text.startswith("{") else 1.0  # noqa: E731
    pair = [
        ScriptedMember("a", drafts=[(call, True)], scorer=prefer_call),
        ScriptedMember("b", drafts=[("It took four hours.", True)], scorer=prefer_call),
    ]
    result = SpecEM(pair, copy_guard_words=5).generate(chat, tools=tools)
    assert result.segments[0].copied == []
    assert result.tool_calls
    assert result.tool_calls[0].name == "lookup"


def test_the_option_is_checked_and_the_paper_keeps_its_rule() -> None:
    assert SpecEMConfig().copy_guard_words == 5
    with pytest.raises(ConfigError, match="copy_guard_words"):
        SpecEMConfig(copy_guard_words=-1)
    assert SpecEMConfig(copy_guard_words=5, reproduce_paper=True).copy_guard_words == 0
