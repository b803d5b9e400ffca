"""llama.cpp's own ``llama-server`` as a member (what most local users run; Ollama is built on it):
built from the llama.cpp source the project compiles (``scripts/build_llama_server.sh``), started
on loopback over the packaged SmolLM2 GGUF. No mocks.

It has no echo; SpecEM drafts through ``/v1/completions`` on the model's template (taken from the
GGUF its served name resolves to, or rendered by the server's ``/apply-template``) and verifies on
the ``forced`` path through ``/completion``: token-id prompts read from the server's KV cache, the
candidate forced by a grammar, ``n_probs`` listing each token's log-prob before sampling, and an
ended candidate's end of turn scored exactly (the matched grammar lets only an end of generation
through, whose log-prob the server lists).

``SPECEM_REQUIRE_LLAMA_SERVER=1`` (``.ci/run``) makes a missing binary a failure, not a skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from avoiding import check_avoiding_the_first_word
from llama_server import LlamaServer, llama_server_binary, scores_beside_transformers, start_llama_cpp_server

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.http.client import RetryPolicy
from specem_core.registry import load_member
from specem_core.types import Candidate

REQUIRED = os.environ.get("SPECEM_REQUIRE_LLAMA_SERVER") == "1"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        llama_server_binary() is None and not REQUIRED,
        reason="no llama-server: bash scripts/build_llama_server.sh builds it",
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FAST = RetryPolicy(max_retries=2, backoff_base=0.2, backoff_max=1.0)


def test_the_llama_server_binary_is_there() -> None:
    """With ``SPECEM_REQUIRE_LLAMA_SERVER=1`` the build must have happened (no silent skip)."""
    assert llama_server_binary() is not None


def serving(alias: str) -> Iterator[LlamaServer]:
    srv = start_llama_cpp_server("smollm2", alias=alias, n_ctx=4096, parallel=2)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServer]:
    yield from serving("smollm2")


@pytest.fixture(scope="module")
def second() -> Iterator[LlamaServer]:
    yield from serving("smollm2-b")


def member(server: LlamaServer, name: str = "smol", **kwargs: Any) -> Any:
    return load_member(f"openai:{server.base_url}#{server.alias}", name=name, retry=FAST, **kwargs)


def test_probe_finds_the_forced_path_and_the_servers_template(server: LlamaServer) -> None:
    m = member(server)
    caps = m.probe()
    assert caps.server == "llama.cpp"
    assert caps.tokenize == "llama.cpp"
    assert caps.renders_messages  # /apply-template
    assert caps.completions
    assert caps.score_paths == ("forced",)
    assert m.verification == "exact"
    assert m.prompt_source == "local"  # the packaged model's name: its own template on this machine
    served = member(server, "served", template_resolver=None)  # nothing local: the server renders
    served.probe()
    assert served.prompt_source == "server"
    session = served.open(SessionRequest(QUESTION))
    assert session.prompt == m.open(SessionRequest(QUESTION)).prompt


def test_forced_scores_match_transformers_on_the_same_weights(server: LlamaServer) -> None:
    """The converted cache holds the dequantized Q4_1 weights the server runs: the same numbers up
    to llama.cpp's activation quantization, ended candidates (their end of turn) included; nothing
    handed elsewhere and nothing inexact."""
    m = member(server)
    for remote, ref in scores_beside_transformers(m, QUESTION):
        for r, lref in zip(remote, ref, strict=True):
            assert r.n_tokens == lref.n_tokens
            assert r.mean_logprob == pytest.approx(lref.mean_logprob, abs=0.2)
    assert m.stats.echo_fallbacks == 0
    assert m.stats.inexact_tokens == 0


def test_verification_reads_the_servers_kv_cache(server: LlamaServer) -> None:
    """The member's own draft carries its tokens' log-probs (before sampling), which score it with
    no request; the other candidate's forced request sends the conversation as token ids, which
    the server reads from its KV cache (``timings.cache_n``)."""
    m = member(server, "cached")
    m.probe()  # how it scores is known before the first draft
    session = m.open(SessionRequest(QUESTION))
    session.commit(session.draft(8, SamplingParams()).text)
    draft = session.draft(8, SamplingParams())
    cands = [Candidate("a", draft.text, draft.ended), Candidate("b", " in Lisbon, making solar panels", False)]
    session.score(cands, score_eos=True)
    trace = session.server_trace()
    assert trace["score_path"] == "forced"
    assert trace["scored_from_draft"] >= len(draft.text.split())
    assert trace["score_requests"] == 1  # the other member's candidate only
    assert trace["echo_fallbacks"] == 0
    assert trace["score_cached_tokens"] >= 0.8 * trace["score_prompt_tokens"], trace


def test_one_member_writes_the_servers_own_greedy_text(server: LlamaServer) -> None:
    """A one-member ensemble is the server: its answer is the server's own greedy completion of
    the same prompt. Which one depends on the server's cache (the members guide: a prompt
    prefilled cold and one read from the cache can get different greedy text), so the answer is
    checked against both: asked after it (read from the cache) and with ``cache_prompt: false``."""
    m = member(server, "alone")
    result = SpecEM([m], SpecEMConfig(max_new_tokens=32, segment_len=8)).generate(QUESTION)
    prompt = m.open(SessionRequest(QUESTION)).prompt
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}
    own = {
        httpx.post(f"{server.base_url}/completions", json={**body, "cache_prompt": cached}, timeout=120)
        .json()["choices"][0]["text"]
        .strip()
        for cached in (True, False)
    }
    assert result.text.strip() in own
    assert m.verification is None  # a member alone never asked how its server scores


def test_a_draft_told_to_avoid_a_word_starts_with_another(server: LlamaServer) -> None:
    """``copy_break``'s redraft on a server: the avoided word's leading tokens are biased away
    (``logit_bias`` from the member's local tokenizer), and the draft's log-probs no longer score
    it (they are the model's own only for a plain greedy draft)."""
    from specem_core.backends.http.tokenizer import avoided_bias

    m = member(server, "avoiding")
    check_avoiding_the_first_word(m.open(SessionRequest(QUESTION)), 8)
    bias = avoided_bias(m.tokenizer, ("paris",))  # the local tokenizer, resolved by the first draft
    assert bias
    assert all(v == -100.0 for v in bias.values())
    assert avoided_bias(m.tokenizer, ()) == {}


def test_a_pair_on_two_llama_servers_votes_exactly(server: LlamaServer, second: LlamaServer) -> None:
    a, b = member(server, "a"), member(second, "b")
    config = SpecEMConfig(max_new_tokens=24, segment_len=6, temperature=0.7, seed=3)
    result = SpecEM([a, b], config).generate(QUESTION)
    assert result.text
    assert not result.excluded
    voted = [s for s in result.segments if len(s.candidates) > 1]
    assert voted, "sampling at 0.7 gave two different drafts in some round"
    for m in (a, b):
        assert m.verification == "exact"
        assert m.stats.score_requests > 0
        assert m.stats.inexact_tokens == 0


def test_a_killed_llama_server_is_excluded_and_the_answer_completes(server: LlamaServer) -> None:
    doomed = start_llama_cpp_server("smollm2", alias="doomed", n_ctx=2048, parallel=1)
    try:
        healthy, dying = member(server, "healthy"), member(doomed, "dying", timeout=10.0)
        dying.probe()
        doomed.stop()
        result = SpecEM([healthy, dying], SpecEMConfig(max_new_tokens=16, segment_len=4)).generate(QUESTION)
        assert result.text
        assert [e.member for e in result.excluded] == ["dying"]
    finally:
        doomed.stop()
