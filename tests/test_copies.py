"""The copy guard (``specem_core.copies``, ``copy_guard_words``): a follow-up is not answered with
an earlier answer when a member answers the new question."""

from __future__ import annotations

import pytest
from scripted import ScriptedMember

from specem_core import ConfigError, SpecEM, SpecEMConfig
from specem_core.copies import CopyGuard, first_word_done, in_code_or_math, opens_with, words

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


def test_when_every_member_repeats_itself_the_vote_stands_without_copy_break() -> None:
    both = members()
    both[1].drafts = [(COPY + " by", False), (" Ana on Monday morning.", True)]
    result = SpecEM(both, copy_guard_words=5, copy_break=False).generate(CHAT)
    assert result.text.startswith(COPY)
    assert result.segments[0].copied == []
    assert result.segments[0].cut_before == ""


def test_the_guard_cut_finds_the_word_that_completes_the_copy() -> None:
    guard = CopyGuard(CHAT, 5)
    assert guard.cut("", NEW) is None
    assert guard.cut("", COPY) == (len("The pump of Press"), "3")  # "the pump of press 3" is the run
    assert guard.cut("The pump of", " Press 3 took") == (len(" Press"), "3")
    assert guard.cut("The pump of Press", ", 3 took") == (0, "3")  # punctuation before the word is drafted again
    assert guard.cut("The pump of Press 3 was", " fixed") is None


def test_opens_with_is_about_the_first_word_only() -> None:
    assert opens_with(" The", ["the"])
    assert opens_with(" th", ["the"])  # may still become "the"
    assert not opens_with(" There", ["the"])
    assert opens_with(", the end", ["the"])
    assert not opens_with(" a the", ["the"])
    assert not opens_with("  ", ["the"])
    assert first_word_done(" The ")
    assert not first_word_done(" The")


def test_code_and_math_are_told_from_prose() -> None:
    assert not in_code_or_math("The pump was replaced. It cost $120 and")
    assert in_code_or_math("Here:\n```python\nimport os\n")
    assert not in_code_or_math("Here:\n```python\nimport os\n```\nThat")
    assert in_code_or_math("Call `top_words(")
    assert in_code_or_math("We have \\( x + y")
    assert not in_code_or_math("We have \\( x + y \\) and")
    assert in_code_or_math("\\[ x + y = 4z")


def test_a_copy_inside_code_is_not_cut() -> None:
    """Repeating a program's unchanged lines is often right: inside a code block the vote stands."""
    program = "```python\nimport os\nfrom collections import Counter\n\ndef top_words(directory):\n```"
    chat = [*CHAT[:2], {"role": "assistant", "content": program}, {"role": "user", "content": "Parallelize it."}]
    opening = "```python\nimport os\n"
    pair = [
        ScriptedMember("a", drafts=[(opening, False), ("from collections import Counter", True)],
                       avoiding={"counter": ("from multiprocessing import Pool", True)}),
        ScriptedMember("b", drafts=[(opening, False), ("from collections import Counter\n", True)],
                       avoiding={"counter": ("import multiprocessing", True)}),
    ]  # fmt: skip
    result = SpecEM(pair, copy_guard_words=5).generate(chat)
    assert all(s.cut_before == "" and s.avoided == [] for s in result.segments)
    assert "from collections import Counter" in result.text


def both_copy() -> list[ScriptedMember]:
    """Both members repeat the earlier answer; asked not to start with the word that completes
    the copy, ``b`` answers the new question and ``a`` still repeats itself."""
    prefer_copy = lambda committed, c: 3.0 if "Press 3" in committed + c.text else 1.0  # noqa: E731
    return [
        ScriptedMember(
            "a",
            drafts=[(COPY, False), (" by Ana on Monday morning.", True)],
            avoiding={"3": (" of Press 3 was replaced", False)},
            scorer=prefer_copy,
        ),
        ScriptedMember(
            "b",
            drafts=[(COPY + " by", False), (" Ana on Monday morning.", True)],
            avoiding={"3": (" repair took four hours.", True)},
            scorer=prefer_copy,
        ),
    ]


def test_when_every_candidate_copies_the_winner_is_cut_and_the_next_drafts_avoid_the_word() -> None:
    pair = both_copy()
    result = SpecEM(pair, copy_guard_words=5).generate(CHAT)  # copy_break is on by default
    first, second = result.segments[:2]
    assert first.cut_before == "3"
    assert first.text == "The pump of Press"
    assert second.avoided == ["3"]
    assert [m.avoided_seen[1] for m in pair] == [("3",), ("3",)]
    assert second.copied == [0]  # a's redraft still copies ("of press 3 was replaced"), b's answers
    assert result.text == "The pump of Press repair took four hours."
    trace = result.trace()["segments"]
    assert trace[0]["cut_before"] == "3"
    assert trace[1]["avoided"] == ["3"]


def test_a_winner_that_copies_from_its_first_word_has_the_round_drafted_again() -> None:
    opening = "The pump of Press"  # four words of the run: no copy yet
    prefer_copy = lambda committed, c: 3.0 if c.text.startswith(" 3") else 1.0  # noqa: E731
    pair = [
        ScriptedMember("a", drafts=[(opening, False), (" 3 was replaced", False)], scorer=prefer_copy,
                       avoiding={"3": (" took four hours.", True)}),
        ScriptedMember("b", drafts=[(opening, False), (" 3 was replaced by", False)], scorer=prefer_copy,
                       avoiding={"3": (" line was down for a day.", True)}),
    ]  # fmt: skip
    result = SpecEM(pair, copy_guard_words=5).generate(CHAT)
    second = result.segments[1]
    assert second.avoided == ["3"]  # drafted again within the round
    assert second.cut_before == ""
    assert [m.avoided_seen for m in pair] == [[(), (), ("3",)], [(), (), ("3",)]]
    assert result.text in {opening + " took four hours.", opening + " line was down for a day."}


def test_when_every_redraft_copies_too_the_vote_stands() -> None:
    opening = "The pump of Press"
    pair = [
        ScriptedMember("a", drafts=[(opening, False), (" 3 was replaced", True)]),
        ScriptedMember("b", drafts=[(opening, False), (" 3 was replaced by Ana", True)]),
    ]
    result = SpecEM(pair, copy_guard_words=5).generate(CHAT)  # the members cannot avoid "3"
    second = result.segments[1]
    assert second.avoided == ["3", "3"]  # drafted again twice, then the vote stood
    assert result.text.startswith(opening + " 3 was replaced")


def test_a_member_alone_is_not_cut() -> None:
    alone = ScriptedMember("a", drafts=[(COPY, False), (" by Ana on Monday morning.", True)])
    result = SpecEM([alone], copy_guard_words=5).generate(CHAT)
    assert result.text == EARLIER
    assert all(s.cut_before == "" and s.avoided == [] for s in result.segments)


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
    assert SpecEMConfig().copy_break
    assert not SpecEMConfig(reproduce_paper=True).copy_break
