"""Server members at the server's own speed and with its own text, on a real llama-cpp-python server.

* Verification on the ``forced`` path reads the server's KV prefix and lists only the candidate's
  tokens; its scores equal the echo path's (a whole prompt listed every time) on fixed rounds, with
  the same winners.
* A member added as the CLI adds it (``openai:URL#MODEL``, no ``tokenizer=``) finds its chat
  template from the served model id, and a one-member ensemble writes the server's own greedy
  text on a 4-turn RAG conversation; an id nothing resolves is warned about at start-up.

The vLLM counterparts are in ``test_openai_http_vllm.py``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from llama_server import LlamaServer, gguf_path, llama_cpp_available, start_server
from server_checks import MESSAGES, Recorder, compare_paths, listed_positions, prefix_hits

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.registry import load_member, served_model_template
from specem_core.types import Candidate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.skipif(
    not llama_cpp_available(),
    reason="llama-cpp-python[server] is not installed (scripts/build_llama_cpp.sh builds and installs it)",
)

PATH_TOLERANCE = 0.15
"""Largest difference allowed between the forced path and the echo path on the fixed rounds: the
forced path computes the candidate one decode step at a time, the echo in one batch (llama.cpp's
quantized kernels are not batch-invariant); a token scored at the wrong place is off by nats."""


@pytest.fixture(scope="module")
def verbose_server() -> Iterator[LlamaServer]:
    """A SmolLM2 server of this module's own that logs what each request read from its KV prefix."""
    server = start_server("smollm2", n_threads=1, n_ctx=2048, verbose=True)
    try:
        yield server
    finally:
        server.stop()


def test_forced_scores_equal_the_echo_scores_on_fixed_rounds(smollm2_server: LlamaServer) -> None:
    spec = f"openai:{smollm2_server.base_url}#smollm2"
    forced = load_member(spec, name="forced", verify_mode="forced")
    echo = load_member(spec, name="echo", verify_mode="echo")
    result = compare_paths(forced, echo)
    print(f"forced vs echo, {len(result.rows)} rounds: largest difference {result.max_difference:.4f} nats")
    assert result.same_token_counts
    assert result.same_winners
    assert result.max_difference <= PATH_TOLERANCE, result.rows
    assert forced.stats.echo_fallbacks == 0
    assert forced.stats.inexact_tokens == 0


def test_verification_reads_the_servers_kv_prefix(verbose_server: LlamaServer) -> None:
    """What the server itself logs: every forced scoring request evaluates only the candidate's
    tokens (the rest of its prompt is read from the KV prefix the draft left), and lists log-probs
    for the candidate's tokens only. The echo path, for contrast, lists every prompt position."""
    recorder = Recorder()
    member = load_member(f"openai:{verbose_server.base_url}#smollm2", name="forced", transport=recorder)
    assert member.probe().scoring_reads_cache
    session = member.open(SessionRequest(MESSAGES))
    session.commit(session.draft(8, SamplingParams()).text)
    draft = session.draft(8, SamplingParams())
    recorder.calls.clear()
    logged = len(prefix_hits(verbose_server.log_path))
    cands = [Candidate("a", draft.text, False), Candidate("b", " in Lisbon, making solar panels", False)]
    row = session.score(cands, score_eos=False)
    scoring = recorder.scoring()
    hits = prefix_hits(verbose_server.log_path)[logged:]
    assert len(scoring) == 2
    assert len(hits) == 2  # one logged prefix hit per scoring request
    for (body, answer), (read, evaluated), got in zip(scoring, hits, row, strict=True):
        assert not body.get("echo")
        assert evaluated <= 1, (read, evaluated)  # the prompt came from the KV prefix
        assert read >= 0.9 * (read + evaluated + got.n_tokens)
        assert listed_positions(answer) == got.n_tokens  # the candidate's tokens, not the prompt's
    trace = session.server_trace()
    assert trace["score_path"] == "forced"
    assert trace["score_requests"] == 2
    echo = load_member(f"openai:{verbose_server.base_url}#smollm2", name="echo", verify_mode="echo", transport=recorder)
    echo.probe()  # how it scores is asked at its first scoring otherwise: not what is counted here
    echo_session = echo.open(SessionRequest(MESSAGES))
    echo_session.commit(draft.text)
    recorder.calls.clear()
    echo_row = echo_session.score(cands, score_eos=False)
    for (_, answer), got in zip(recorder.scoring(), echo_row, strict=True):
        assert listed_positions(answer) > 10 * got.n_tokens  # every prompt position, every time


@pytest.mark.parametrize("served_as", ["smollm2", "gguf"])
def test_one_member_ensemble_writes_the_servers_own_greedy_text(smollm2_server: LlamaServer, served_as: str) -> None:
    """Added as the CLI adds it (no ``tokenizer=``): the served model id is a packaged model's name
    (its converted tokenizer) or the GGUF file's path (llama-cpp-python's default id; the template
    the file carries, no conversion). Every turn of the RAG conversation is the text the server's
    own greedy chat completion writes.

    Which text that is depends on the server's cache: llama-cpp-python evaluates only what a prompt
    does not share with the previous one, and a prompt prefilled cold and one read from the cache
    but for its last token can get different greedy text (the numerics of one batch against
    another: seen with this machine's AVX2 build). So each turn asks the server twice, cold
    (after an unrelated request) and warm (the same request again), and the ensemble's text must be
    one of the two; where the server is stable they are the same text."""
    from multiturn import rag_turns

    model = "smollm2" if served_as == "smollm2" else str(gguf_path("smollm2"))
    member = load_member(f"openai:{smollm2_server.base_url}#{model}", name="solo")
    engine = SpecEM([member], SpecEMConfig(segment_len=10, max_new_tokens=32))
    system, questions = rag_turns(4, context_lines=8)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]

    def alone(conversation: list[dict[str, str]], max_tokens: int = 32) -> str:
        answer = httpx.post(
            f"{smollm2_server.base_url}/chat/completions",
            json={"messages": conversation, "max_tokens": max_tokens, "temperature": 0.0, "repeat_penalty": 1.0},
            timeout=300,
        ).json()
        return str(answer["choices"][0]["message"]["content"])

    unstable = 0
    for question in questions:
        messages.append({"role": "user", "content": question})
        alone([{"role": "user", "content": "Say nothing."}], max_tokens=1)  # the next prompt shares nothing
        cold = alone(messages)
        warm = alone(messages)  # all but the last token from the cache
        unstable += cold != warm
        result = engine.generate(messages)
        assert result.text in (cold, warm), (question, result.text, cold, warm)
        messages.append({"role": "assistant", "content": result.text})
    assert unstable < len(questions)  # mostly one text: the check is not vacuous
    assert member.prompt_source == "local"
    assert member.modes[0] == "completions"


def test_packaged_model_names_resolve_to_a_template_without_conversion() -> None:
    """The 1.5B is never converted (llama.cpp only): its name, alias and GGUF file name give the
    template its GGUF carries, with its end-of-turn token."""
    from specem_core.models import find_packaged, local_gguf

    packaged = find_packaged("qwen2.5-coder-1.5b")
    assert packaged is not None
    if local_gguf(packaged) is None:
        pytest.skip("the 1.5B GGUF is not assembled on this machine (specem models pull qwen2.5-coder-1.5b)")
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b", packaged.gguf_name):
        template = served_model_template(name)
        assert template is not None, name
        assert template.end_of_turn == "<|im_end|>"
        assert "<|im_start|>assistant\n" in template.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert served_model_template("no-such-model") is None
    assert served_model_template("org/not-in-the-local-cache") is None


def test_an_id_nothing_resolves_is_warned_about_at_start_up(
    smollm2_server: LlamaServer, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-cpp-python serves its one model under any name; nothing on this machine knows
    ``my-private-model``, and llama-cpp-python renders no conversations: the member says so when it
    is probed (the CLI probes at start-up) and names the fix."""
    from specem_integrations.cli import main

    with caplog.at_level(logging.WARNING, logger="specem.http"):
        member = load_member(f"openai:{smollm2_server.base_url}#my-private-model", name="private")
        member.probe()
    assert member.prompt_source == "plain"
    assert "no chat template for model 'my-private-model'" in caplog.text
    assert "tokenizer=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specem.http"):
        code = main(
            [
                "chat",
                "Hi",
                "--model",
                f"openai:{smollm2_server.base_url}#my-private-model",
                "--max-tokens",
                "2",
            ]
        )
    assert code == 0, capsys.readouterr().err
    assert "tokenizer=" in caplog.text


def test_server_member_without_resolver_keeps_the_plain_format(smollm2_server: LlamaServer) -> None:
    """An :class:`OpenAIHTTPMember` built directly (no registry) resolves nothing by itself."""
    member = OpenAIHTTPMember(smollm2_server.base_url, name="direct")
    member.probe()
    assert member.prompt_source == "plain"
    assert member.chat is None
