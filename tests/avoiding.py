"""The check every backend's drafts pass for ``SamplingParams.avoid_words`` (``copy_break``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specem_core import Draft, SamplingParams
from specem_core.copies import opens_with, words


def check_avoiding_the_first_word(session: Any, n: int, then: Callable[[Draft], None] = lambda d: None) -> None:
    """A draft told to avoid its greedy draft's first word starts with another (``then`` sees it
    before the session drafts again); a word the draft does not start with changes nothing, and
    nothing stays avoided after."""
    plain = session.draft(n, SamplingParams())
    first = words(plain.text)[0]
    avoiding = session.draft(n, SamplingParams(avoid_words=(first,)))
    assert avoiding.text.strip()
    assert not opens_with(avoiding.text, [first])
    then(avoiding)
    assert session.draft(n, SamplingParams(avoid_words=("zebra",))).text == plain.text
    assert session.draft(n, SamplingParams()).text == plain.text
