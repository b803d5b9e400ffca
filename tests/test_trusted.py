"""Which member is trusted (``specem_core.trusted.choose_trusted``), and the ``trusted_member``
option that names it for members a user brings (no measured prior): the rule, its reasons in the
result and the trace, its checks, and that the trusted member's rules follow the named member."""

from __future__ import annotations

import pytest
from scripted import ScriptedMember

from specem_core import ConfigError, SpecEM, SpecEMConfig, Trusted
from specem_core.weights import MemberWeights


def pair() -> list[ScriptedMember]:
    """Two members that each draft their own answer, each scoring its own draft highest."""

    def own_first(name: str) -> object:
        return lambda committed, c: 2.0 if c.text.startswith(name.upper()) else 1.0

    return [
        ScriptedMember("a", drafts=[("A says one", True)], scorer=own_first("a")),  # type: ignore[arg-type]
        ScriptedMember("b", drafts=[("B says two", True)], scorer=own_first("b")),  # type: ignore[arg-type]
    ]


def test_the_rule_named_then_the_prior_then_none() -> None:
    plain = SpecEM(pair())
    assert plain.trusted() == Trusted(None, "no member weights and no trusted_member: no member is trusted")
    assert plain.trusted(trusted_member="b") == Trusted("b", "named by trusted_member")
    priored = SpecEM(pair(), member_weights=MemberWeights({"a": 1.0, "b": 3.0}))
    assert priored.trusted() == Trusted("b", "the highest prior in the member weights: 3")
    assert priored.trusted(trusted_member="a").member == "a"  # the option wins over the prior
    tied = SpecEM(pair(), member_weights=MemberWeights({"a": 2.0, "b": 2.0}))
    assert tied.trusted() == Trusted(None, "the member weights' prior ties: no member is trusted")


def test_the_result_and_the_trace_say_who_was_trusted_and_why() -> None:
    result = SpecEM(pair(), SpecEMConfig(trusted_member="a")).generate("q")
    assert result.trusted == Trusted("a", "named by trusted_member")
    assert result.trace()["trusted"] == {"member": "a", "reason": "named by trusted_member"}
    assert result.to_dict()["trusted"]["member"] == "a"
    assert SpecEM(pair()).generate("q").trusted == Trusted(
        None, "no member weights and no trusted_member: no member is trusted"
    )


def test_the_trusted_rules_follow_the_named_member_without_member_weights() -> None:
    """With members of one's own (no prior), ``trusted_member`` is what turns the trusted rules
    on: the opening is the named member's, and its veto keeps its own draft."""
    untrusted = SpecEM(pair(), trusted_opening_rounds=1).generate("q")
    assert untrusted.segments[0].drafters == ["a", "b"]  # no member trusted: everyone drafts
    for name in ("a", "b"):
        opening = SpecEM(pair(), trusted_opening_rounds=1, trusted_member=name).generate("q")
        assert opening.segments[0].drafters == [name]
        assert opening.text == f"{name.upper()} says {'one' if name == 'a' else 'two'}"
        vetoed = SpecEM(pair(), trusted_veto=True, trusted_member=name).generate("q")
        assert vetoed.segments[0].winner == name


def test_a_name_that_is_no_drafter_is_refused_where_it_is_given() -> None:
    with pytest.raises(ConfigError, match="trusted_member 'c' is not a member; the members are a, b"):
        SpecEM(pair(), trusted_member="c")
    engine = SpecEM(pair())
    with pytest.raises(ConfigError, match="trusted_member 'c' is not a member"):
        engine.generate("q", trusted_member="c")
    judge = ScriptedMember("j", can_draft=False)
    with pytest.raises(ConfigError, match="trusted_member 'j' only verifies"):
        SpecEM([*pair(), judge], trusted_member="j")
    with pytest.raises(ConfigError, match="trusted_member must be a member's name or None"):
        SpecEMConfig(trusted_member="")


def test_an_excluded_trusted_member_is_reported_and_the_others_answer() -> None:
    members = pair()
    members[1].fail_on = {"open"}
    result = SpecEM(members, trusted_member="b", trusted_opening_rounds=1, member_retries=0).generate("q")
    assert result.trusted is not None
    assert result.trusted.member is None
    assert "trusted_member b is not in this request" in result.trusted.reason
    assert [e.member for e in result.excluded] == ["b"]
    assert result.text == "A says one"
