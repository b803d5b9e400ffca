"""The trusted member and the rules built on it (our additions to the paper's loop).

With member weights (:class:`~specem_core.weights.MemberWeights`) one drafter can be *trusted*:
the one with the highest prior (evidence of correctness, e.g. accuracy alone on labelled
examples), then the larger model. Votes measure likelihood, which favours a weaker member's more
predictable text; these rules keep the trusted member's judgement where that matters (what each
one measured: ``docs/reports/quality.md``):

- :meth:`TrustedMember.solo_drafter`: it drafts the opening alone (``trusted_opening_rounds``) and
  the rest of a tool call it started (``trusted_tool_calls``), unvoted;
- :func:`unanimous_call_opening`: an answer opens with a tool call only when every drafter's
  opening does (``unanimous_tool_calls``);
- :meth:`TrustedMember.veto`: another member's segment wins only when the trusted member scores it
  at least as high as its own draft (``trusted_veto``);
- Model Exit never stops it (``model_exit_keeps_trusted``, :class:`~specem_core.scoring.ModelExit`).

:func:`gated` is the other use of member weights: members whose learned share is too low sit the
request out (``MemberWeights.min_share``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specem_core.backends.base import Member, draft_cost
from specem_core.config import SpecEMConfig
from specem_core.errors import ConfigError
from specem_core.tools import call_in_progress, opens_call, opens_tool_listing
from specem_core.types import Candidate
from specem_core.weights import MemberWeights


def trusted_drafter(
    members: Sequence[Member], weights: Mapping[int, float], learned: MemberWeights | None
) -> int | None:
    """The drafter the prior trusts most: the highest prior in the member weights; among equal
    priors the larger model (``draft_cost``), then the higher starting weight. ``None`` without
    member weights or when a tie remains.

    The prior comes first because it is the evidence of correctness, while what the weights
    learned comes from votes, i.e. likelihood (docs/reports/quality.md, "Lessons learned")."""
    if learned is None:
        return None
    ranked = sorted(
        ((learned.prior_of(members[i].name), draft_cost(members[i]), w), i)
        for i, w in weights.items()
        if members[i].can_draft
    )
    if not ranked or (len(ranked) > 1 and ranked[-1][0] == ranked[-2][0]):
        return None
    return ranked[-1][1]


def choose_trusted(
    members: Sequence[Member],
    weights: Mapping[int, float],
    learned: MemberWeights | None,
    named: str | None,
) -> tuple[int | None, str]:
    """The trusted drafter of a request and why, by the documented rule: the member named by
    ``trusted_member`` (``named``); else the highest prior in the member weights
    (:func:`trusted_drafter`); else none. ``weights``: the request's drafters and verifiers (a
    member excluded or gated before the first round is not among them)."""
    if named is not None:
        index = next((i for i, m in enumerate(members) if m.name == named), None)
        if index is None or index not in weights:
            return None, f"trusted_member {named} is not in this request (excluded or gated): no member is trusted"
        return index, "named by trusted_member"
    index = trusted_drafter(members, weights, learned)
    if index is not None:
        assert learned is not None
        return index, f"the highest prior in the member weights: {learned.prior_of(members[index].name):.4g}"
    if learned is None:
        return None, "no member weights and no trusted_member: no member is trusted"
    return None, "the member weights' prior ties: no member is trusted"


def check_trusted_member(members: Sequence[Member], named: str | None) -> None:
    """``trusted_member`` names a member that drafts.

    Raises:
        ConfigError: no member has that name, or that member only verifies.
    """
    if named is None:
        return
    names = [m.name for m in members]
    if named not in names:
        raise ConfigError(f"trusted_member {named!r} is not a member; the members are {', '.join(names)}")
    if not members[names.index(named)].can_draft:
        raise ConfigError(f"trusted_member {named!r} only verifies: the trusted member must draft")


class TrustedMember:
    """The trusted member of one request (fixed at its start) and the rules that use it.

    Args:
        index: the trusted drafter (:func:`choose_trusted`), or ``None``.
        config: the request's configuration.
        tools: whether tools were offered.
    """

    def __init__(self, index: int | None, config: SpecEMConfig, *, tools: bool) -> None:
        self.index = index
        self.config = config
        self.tools = tools
        self.opening = index if config.trusted_opening_rounds else None
        """The member that drafts the first rounds alone (``trusted_opening_rounds``)."""

    def solo_drafter(self, k: int, available: Sequence[int], active: Sequence[int], text: str) -> int | None:
        """The trusted member when it writes round ``k`` alone: the opening
        (``trusted_opening_rounds``), or the rest of a tool call the answer has started
        (``trusted_tool_calls``); ``None`` when the round is drafted by all ``available``."""
        if k <= self.config.trusted_opening_rounds and self.opening in available:
            return self.opening
        if (
            self.config.trusted_tool_calls
            and self.tools
            and self.index is not None
            and self.index in active  # not excluded since the start
            and call_in_progress(text)
        ):
            return self.index
        return None

    def decides_call_opening(self, k: int, text: str) -> bool:
        """Whether round ``k`` decides if the answer opens with a tool call or in words
        (``unanimous_tool_calls``): the first round of an answer that may call a tool."""
        return self.config.unanimous_tool_calls and k == 1 and self.tools and not text

    def veto(
        self,
        winner: int,
        owners: Sequence[int],
        verifiers: Sequence[int],
        candidates: Sequence[Candidate],
        raw: Sequence[Sequence[float]],
    ) -> int:
        """``trusted_veto``: the vote's ``winner`` stands when the trusted member drafted it, or
        scores it (``raw``, its row) at least as high as its own draft; otherwise the trusted
        member's draft wins."""
        trusted = self.index
        if trusted is None or trusted not in owners or trusted not in verifiers:
            return winner
        own = owners.index(trusted)
        if (candidates[winner].text, candidates[winner].ended) == (candidates[own].text, candidates[own].ended):
            return winner
        row = raw[verifiers.index(trusted)]
        return winner if row[winner] >= row[own] else own


def unanimous_call_opening(
    owners: list[int], candidates: list[Candidate], solo: int | None
) -> tuple[list[int], list[Candidate]]:
    """``unanimous_tool_calls``: the openings that start a call are dropped when another opening
    is words; then the trusted member's opening, when it drafts the opening alone
    (``trusted_opening_rounds``, ``solo``) and is among those left, is the only one. (When it
    drafts alone and opens in words, the others were not asked: their openings could not change
    it.) An opening that repeats the prompt's tool listing is not words: a member that starts to
    write out the tools it was shown is not answering without them."""
    calls = [opens_call(c.text) for c in candidates]
    words = [n for n, c in enumerate(candidates) if c.text.strip() and not calls[n] and not opens_tool_listing(c.text)]
    keep = words if words and any(calls) else list(range(len(candidates)))
    if solo is not None and solo in owners and owners.index(solo) in keep:
        keep = [owners.index(solo)]
    return [owners[n] for n in keep], [candidates[n] for n in keep]


def gated(members: Sequence[Member], learned: MemberWeights | None) -> dict[int, float]:
    """The members the learned weights keep out of this request (``MemberWeights.min_share``),
    with their share; the best-weighted drafter always stays."""
    if learned is None:
        return {}
    verifiers = [i for i, m in enumerate(members) if m.can_verify]
    low = learned.gated([members[i].name for i in verifiers])
    share = {i: low[members[i].name] for i in verifiers if members[i].name in low}
    if share and not any(m.can_draft for i, m in enumerate(members) if i not in share):
        del share[max((i for i in share if members[i].can_draft), key=share.__getitem__)]
    return share
