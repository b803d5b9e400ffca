"""The answers of the cache-reading scoring paths, read as the member reads them (the paths
themselves run against real servers in ``test_openai_http_vllm.py`` and ``test_openai_http_cache.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from specem_core.backends.http.errors import AlignmentError, ServerResponseError
from specem_core.backends.http.token_scoring import prompt_tail_logprobs

IDS = [11, 12, 13, 14, 15, 16]


def tail_answer(cached: int | None, values: dict[int, float]) -> dict[str, Any]:
    """A ``/inference/v1/generate`` answer as vLLM 0.32 writes it: a row per prompt position, the
    cached ones holding whatever its buffer held."""
    rows: list[Any] = [None]
    for p in range(1, len(IDS)):
        if p in values:
            rows.append({str(IDS[p]): {"logprob": values[p], "rank": 1, "decoded_token": None}})
        else:
            rows.append({"-467721536": {"logprob": -1.17e22, "rank": -467721520, "decoded_token": None}})
    usage: dict[str, Any] = {"prompt_tokens": len(IDS), "completion_tokens": 1}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"prompt_logprobs": rows, "usage": usage}


def test_only_the_positions_after_the_cached_ones_are_read() -> None:
    """Position ``cached`` itself is not computed either: its log-prob comes from the state of the
    position before it, which was read from the cache."""
    answer = tail_answer(3, {4: -0.5, 5: -1.25})
    assert prompt_tail_logprobs(answer, IDS) == {4: -0.5, 5: -1.25}


def test_nothing_cached_gives_every_position_but_the_first() -> None:
    values = {p: -float(p) for p in range(1, len(IDS))}
    assert prompt_tail_logprobs(tail_answer(0, values), IDS) == values


def test_an_answer_that_does_not_say_what_it_read_from_cache_is_refused() -> None:
    with pytest.raises(ServerResponseError, match="cached prompt tokens"):
        prompt_tail_logprobs(tail_answer(None, {4: -0.5, 5: -1.25}), IDS)


def test_a_computed_position_without_its_token_is_an_alignment_error() -> None:
    answer = tail_answer(3, {4: -0.5})  # position 5 holds another token's entry
    with pytest.raises(AlignmentError, match="prompt token 5"):
        prompt_tail_logprobs(answer, IDS)


def test_rows_not_matching_the_prompt_are_refused() -> None:
    answer = tail_answer(3, {4: -0.5, 5: -1.25})
    with pytest.raises(ServerResponseError, match="every prompt token"):
        prompt_tail_logprobs(answer, [*IDS, 17])
