"""vLLM's cache-reading scoring paths (``prompt_tail``, ``next_token``) on the in-process fake.

``test_openai_http_vllm.py`` runs them against a real vLLM where its environment is installed; the
fake (:meth:`fake_openai_server.FakeServer.vllm`) speaks the same requests everywhere: ``/tokenize``
and ``/detokenize`` beside ``/v1``, token-id prompts with ``logprob_token_ids``, the token-in-token-out
endpoint of ``--enable-scale-out`` with a prefix cache in whole blocks, ``cached_tokens`` with
``--enable-prompt-tokens-details``, and the 400 of an answer vLLM cannot write. Its log-prob of a
token depends on the tokens before it and is the same on every endpoint, so every path must give
the echo path's scores exactly, and a token scored after the wrong prefix would not.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_openai_server import CHATML, STALE, FakeServer, render_messages, token_id, token_text, tokenize
from server_checks import FIXED_ROUNDS, MESSAGES

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.http.client import RetryPolicy
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.backends.http.probing import PROMPT_TAIL_PROBE_TRIES
from specem_core.types import Candidate, CandidateScore

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FAST = RetryPolicy(max_retries=2, backoff_base=0.001, backoff_max=0.01)
EXACT = 1e-9
"""Every path reads the same log-probs: the scores may differ by float rounding only."""
GENERATE = "/inference/v1/generate"


def url(server: FakeServer) -> str:
    """One API root per fake server (the probe's answers are cached per server URL)."""
    return f"http://vllm-{id(server):x}.test/v1"


def vllm_member(server: FakeServer, name: str, **kwargs: Any) -> OpenAIHTTPMember:
    kwargs.setdefault("chat_template", CHATML)
    kwargs.setdefault("end_of_turn", "<|im_end|>")
    kwargs.setdefault("retry", FAST)
    return OpenAIHTTPMember(url(server), name=name, transport=server.transport(), **kwargs)


def calls_to(server: FakeServer, suffix: str) -> list[dict[str, Any]]:
    return [body for path, body in server.calls if path.endswith(suffix)]


def score_rounds(member: OpenAIHTTPMember, *, draft: bool = False) -> tuple[list[list[CandidateScore]], Any]:
    """Score :data:`server_checks.FIXED_ROUNDS` (committing round by round, as the engine does), then
    one more round on the last answer with an ended candidate and end-of-turn scoring, and (with
    ``draft``) the member's own greedy draft among the candidates. The rows and the session."""
    session = member.open(SessionRequest(MESSAGES))
    rows = []
    committed = ""
    for text, cands in FIXED_ROUNDS:
        session.commit(text[len(committed) :])
        committed = text
        rows.append(session.score(cands, score_eos=False))
    own = " and so on and so on"  # what the fake drafts here (its answer is not this conversation's)
    if draft:
        drafted = session.draft(6, SamplingParams())
        assert drafted.text == own
    last = [Candidate("a", " textbooks.", True), Candidate("b", own, False), Candidate("c", "", True)]
    rows.append(session.score(last, score_eos=True))
    return rows, session


def assert_same_scores(fast: list[list[CandidateScore]], echo: list[list[CandidateScore]]) -> None:
    assert len(fast) == len(echo)
    for row, ref in zip(fast, echo, strict=True):
        assert [s.n_tokens for s in row] == [s.n_tokens for s in ref]
        assert all(s.n_tokens > 0 for s in ref)
        for s, r in zip(row, ref, strict=True):
            assert s.mean_logprob is not None
            assert r.mean_logprob is not None
            assert s.mean_logprob == pytest.approx(r.mean_logprob, abs=EXACT), (row, ref)


# -- the fake itself ------------------------------------------------------------------------------
def test_the_fake_gives_a_token_the_same_logprob_on_every_endpoint() -> None:
    """The contract the path comparisons below rest on: token ids round-trip, the tokenizer
    endpoints live beside ``/v1``, the prefix cache is read in whole blocks (never the last token),
    and the log-prob of a token after the same tokens is the same whichever endpoint gives it."""
    server = FakeServer.vllm(block_size=16)
    client = httpx.Client(transport=server.transport(), base_url="http://fake.test")
    answer = (
        "The capital of France is Paris, a city on the Seine. About 2 million people live in its 20 districts, "
        "and many more visit its museums and parks every year."
    )
    text = render_messages(QUESTION) + answer
    ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert [token_text(i) for i in ids] == tokenize(text)
    assert [token_id(t) for t in tokenize(text)] == ids
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    assert client.post("/v1/tokenize", json={"prompt": text}).status_code == 404  # vLLM's is not under /v1
    rendered = client.post("/tokenize", json={"messages": QUESTION, "add_generation_prompt": True}).json()["tokens"]
    assert rendered == ids[: len(rendered)]
    assert len(ids) > 48

    echo = client.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"]
    assert echo["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # prompt log-probs: a full prefill

    params = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False, "skip_reading_prefix_cache": False}
    first = client.post(GENERATE, json={"token_ids": ids, "sampling_params": params}).json()
    again = client.post(GENERATE, json={"token_ids": ids, "sampling_params": params}).json()
    cached = (len(ids) - 1) // 16 * 16  # whole blocks, the last token computed
    assert cached > 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    rows = again["prompt_logprobs"]
    assert len(rows) == len(ids)
    assert rows[0] is None
    for p in range(1, len(ids)):
        value = rows[p][str(ids[p])]["logprob"]
        assert value == (STALE if p <= cached else echoed[p]), p
    first_rows = first["prompt_logprobs"]
    computed = first["usage"]["prompt_tokens_details"]["cached_tokens"]  # what the echo left in the cache
    assert all(first_rows[p][str(ids[p])]["logprob"] == echoed[p] for p in range(computed + 1, len(ids)))

    for p in (1, 17, len(ids) - 1):
        body = {
            "prompt": ids[:p],
            "max_tokens": 1,
            "logprobs": 0,
            "logprob_token_ids": [ids[p]],
            "return_tokens_as_token_ids": True,
        }
        answer = client.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["logprobs"]["top_logprobs"][0][f"token_id:{ids[p]}"] == echoed[p]

    prompt = render_messages(QUESTION)
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": 0, "return_token_ids": True}
    drafted = client.post("/v1/completions", json=body).json()["choices"][0]
    generated = drafted["prompt_token_ids"] + drafted["token_ids"]
    assert generated == ids[: len(generated)]
    assert drafted["logprobs"]["token_logprobs"] == echoed[len(drafted["prompt_token_ids"]) : len(generated)]
    chat = client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, "logprobs": True}).json()
    assert [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]] == drafted["logprobs"]["token_logprobs"]

    assert client.post("/v1/completions", json={**body, "prompt": [10**6]}).status_code == 400  # not a token
    closed = FakeServer.vllm(scale_out=False)
    refused = httpx.Client(transport=closed.transport(), base_url="http://fake.test").post(
        GENERATE, json={"token_ids": ids, "sampling_params": params}
    )
    assert refused.status_code == 403
    assert "--enable-scale-out" in refused.json()["error"]["message"]


# -- probing --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "paths", "note"),
    [
        ({}, ("prompt_tail", "next_token", "echo"), None),
        ({"scale_out": False}, ("next_token", "echo"), "--enable-scale-out"),
        ({"prompt_tokens_details": False}, ("next_token", "echo"), "--enable-prompt-tokens-details"),
    ],
    ids=["scale-out+details", "no-scale-out", "no-details"],
)
def test_probe_finds_the_paths_the_server_was_started_with(
    flags: dict[str, bool], paths: tuple[str, ...], note: str | None
) -> None:
    server = FakeServer.vllm(**flags)
    m = vllm_member(server, "m")
    caps = m.probe()
    assert caps.server == "vllm"
    assert caps.tokenize == "vllm"
    assert caps.renders_messages
    assert caps.echo_shift == 0
    assert caps.next_token_logprobs
    assert caps.score_paths == paths
    assert m.score_path == paths[0]
    assert caps.scoring_reads_cache
    assert caps.prompt_tail == ("prompt_tail" in paths)
    assert caps.reports_cached_tokens == flags.get("prompt_tokens_details", True)
    assert m.modes == ("completions", "logprobs")
    tail_probes = calls_to(server, GENERATE)
    if note is None:
        assert not any("scale-out" in n or "cached prompt tokens" in n for n in caps.notes), caps.notes
        assert tail_probes
        assert all(b["sampling_params"]["skip_reading_prefix_cache"] is False for b in tail_probes)
    else:
        assert any(note in n for n in caps.notes), caps.notes
    if flags.get("scale_out") is False:
        assert any("403" in n for n in caps.notes), caps.notes
    if flags.get("prompt_tokens_details") is False:  # prompt_tail needs to know which rows were computed
        assert tail_probes == []
        assert any("cached prompt tokens" in n for n in caps.notes), caps.notes


def test_probe_of_a_vllm_without_the_token_endpoints_finds_echo_only() -> None:
    """The fake as it was (``token_ids`` off): the tokenizer endpoint is a 404, scoring takes echo."""
    server = FakeServer(dialect="vllm")
    m = vllm_member(server, "m")
    caps = m.probe()
    assert caps.score_paths == ("echo",)
    assert m.score_path == "echo"
    assert any("tokenizer endpoint unavailable (404)" in n for n in caps.notes), caps.notes


def test_an_endpoint_that_refuses_the_probe_is_not_used() -> None:
    server = FakeServer.vllm(tail_400_when=lambda ids: True)
    m = vllm_member(server, "m")
    caps = m.probe()
    assert server.tail_400s == PROMPT_TAIL_PROBE_TRIES
    assert caps.score_paths == ("next_token", "echo")
    assert m.score_path == "next_token"
    assert any("refused the probe (400, 3 tries)" in n for n in caps.notes), caps.notes


def test_a_probe_refused_by_luck_is_tried_again() -> None:
    """vLLM's 400 for a NaN it never wrote comes by luck: refused twice, then answered, the
    endpoint is used."""
    refusals = iter([True, True])
    server = FakeServer.vllm(tail_400_when=lambda ids: next(refusals, False))
    m = vllm_member(server, "m")
    caps = m.probe()
    assert server.tail_400s == 2
    assert caps.score_paths[0] == "prompt_tail"
    assert m.score_path == "prompt_tail"
    assert not any("refused the probe" in n for n in caps.notes), caps.notes


def test_forcing_a_path_the_server_lacks_is_refused() -> None:
    from specem_core.backends.http.errors import CapabilityError

    server = FakeServer.vllm(scale_out=False)
    with pytest.raises(CapabilityError, match="prompt_tail"):
        vllm_member(server, "m", verify_mode="prompt_tail").probe()


# -- scoring --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["prompt_tail", "next_token"])
def test_cache_paths_score_exactly_like_echo(path: str) -> None:
    server = FakeServer.vllm()
    fast = vllm_member(server, path, verify_mode=path)
    echo = vllm_member(server, "echo", verify_mode="echo")
    echo.probe()
    assert fast.probe().score_paths[0] == path  # a forced next_token member does not ask for prompt_tail
    echo_rows, echo_session = score_rounds(echo)
    before = len(calls_to(server, GENERATE))
    fast_rows, session = score_rounds(fast, draft=True)
    assert_same_scores(fast_rows, echo_rows)
    for row in echo_rows:  # the candidates' scores differ: equal rows mean equal log-probs, token by token
        assert len({round(s.mean_logprob or 0.0, 6) for s in row}) == len(row), row

    trace = session.server_trace()
    assert fast.score_path == path
    assert trace["score_path"] == path
    assert trace["verification"] == "exact"
    assert trace["tail_fallbacks"] == 0
    assert trace["echo_fallbacks"] == 0
    assert trace["scored_from_draft"] == len(tokenize(" and so on and so on"))  # the own draft: no request
    assert trace["score_requests"] > 0
    assert trace["score_cached_tokens"] > 0  # the server reported what it read from its prefix cache
    assert fast.stats.tail_fallbacks == fast.stats.echo_fallbacks == 0
    tail_requests = len(calls_to(server, GENERATE)) - before
    if path == "prompt_tail":
        # one per candidate but the own draft (scored from its log-probs): the fixed rounds' and two
        assert tail_requests == sum(len(c) for _, c in FIXED_ROUNDS) + 2
    else:
        assert tail_requests == 0
    echo_trace = echo_session.server_trace()
    assert echo_trace["score_path"] == "echo"
    assert echo_trace["score_cached_tokens"] == 0  # vLLM computes prompt log-probs in a full prefill


def test_prompt_tail_reads_the_prefix_cache_in_whole_blocks() -> None:
    """As ``test_verification_reads_the_prefix_cache`` checks on a real vLLM: every scoring request
    reads all its prompt from the cache but the tail since its last full block and the candidate."""
    server = FakeServer.vllm(
        block_size=16, answer="Company E4, in Osaka, makes textbooks and sells them to many schools in Japan."
    )
    m = vllm_member(server, "tail", verify_mode="prompt_tail")
    m.probe()  # the scoring probe's requests done (it may run beside the first draft)
    session = m.open(SessionRequest(MESSAGES))
    session.commit(session.draft(8, SamplingParams()).text)
    own = session.draft(8, SamplingParams())
    assert (own.text, own.ended) == (" textbooks and sells them to many schools in", False)
    start = len(server.calls)
    cands = [Candidate("a", own.text, own.ended), Candidate("b", " in Lisbon, making solar panels", False)]
    session.score(cands, score_eos=False)
    scoring = [body for path, body in server.calls[start:] if path.endswith(GENERATE)]
    assert len(scoring) == 1  # the own draft is scored from its log-probs
    ids = scoring[0]["token_ids"]
    candidate = len(tokenize(" in Lisbon, making solar panels"))
    trace = session.server_trace()
    assert trace["score_requests"] == 1
    cached = trace["score_cached_tokens"]
    assert cached % 16 == 0
    assert cached >= len(ids) - 16 - candidate
    assert trace["scored_from_draft"] == len(tokenize(own.text))


@pytest.mark.parametrize("inject", ["every-second", "for-robots"])
def test_answers_vllm_cannot_write_are_scored_on_next_token(inject: str) -> None:
    server = FakeServer.vllm()
    fast = vllm_member(server, "tail", verify_mode="prompt_tail")
    echo = vllm_member(server, "echo", verify_mode="echo")
    echo.probe()
    fast.probe()
    assert fast.score_path == "prompt_tail"  # the probe's request was answered
    seen = len(calls_to(server, GENERATE))
    if inject == "every-second":
        server.tail_400_every = 2
    else:
        robots = token_id(" robots")
        server.tail_400_when = lambda ids: robots in ids
    fast_rows, session = score_rounds(fast)
    echo_rows, _ = score_rounds(echo)
    assert_same_scores(fast_rows, echo_rows)
    sent = len(calls_to(server, GENERATE)) - seen
    expected = sent // 2 if inject == "every-second" else 1
    assert server.tail_400s == expected > 0
    assert fast.stats.tail_fallbacks == server.tail_400s
    trace = session.server_trace()
    assert trace["tail_fallbacks"] == server.tail_400s
    assert trace["echo_fallbacks"] == 0
    assert trace["score_path"] == "prompt_tail"


# -- the engine -----------------------------------------------------------------------------------
def ensemble(path: str) -> tuple[Any, list[FakeServer], list[OpenAIHTTPMember]]:
    weights = {" Lyon": -3.0, " Paris": -0.2}
    paris = FakeServer.vllm(answer="The capital of France is Paris, on the Seine.", weights=weights)
    lyon = FakeServer.vllm(answer="The capital of France is Lyon, not Paris.", weights=weights)
    members = [vllm_member(lyon, "lyon", verify_mode=path), vllm_member(paris, "paris", verify_mode=path)]
    config = SpecEMConfig(segment_len=3, max_new_tokens=24)
    return SpecEM(members, config).generate(QUESTION), [lyon, paris], members


def test_ensemble_on_prompt_tail_writes_what_it_writes_on_echo() -> None:
    tail, tail_servers, tail_members = ensemble("prompt_tail")
    echo, echo_servers, _ = ensemble("echo")
    assert tail.text == echo.text
    assert tail.text == "The capital of France is Paris, on the Seine."
    assert len(tail.segments) >= 4
    assert [s.winner for s in tail.segments] == [s.winner for s in echo.segments]
    assert [s.text for s in tail.segments] == [s.text for s in echo.segments]
    assert {s.winner for s in tail.segments} == {"lyon", "paris"}  # the vote mattered: Lyon lost its round
    for a, b in zip(tail.segments, echo.segments, strict=True):
        for row, ref in zip(a.raw_scores, b.raw_scores, strict=True):
            assert row == pytest.approx(ref, abs=EXACT)
    assert tail.excluded == echo.excluded == []
    for m in tail_members:
        assert m.score_path == "prompt_tail"
        assert m.stats.tail_fallbacks == m.stats.echo_fallbacks == 0
        assert m.stats.score_cached_tokens > 0
    assert all(calls_to(s, GENERATE) for s in tail_servers)
    assert not any(calls_to(s, GENERATE) for s in echo_servers)


# -- prompts the server renders -------------------------------------------------------------------
def test_server_rendered_prompt_scores_on_prompt_tail() -> None:
    """No local template: the server renders the conversation (``/tokenize`` with messages, then
    ``/detokenize``), and drafting and every scoring path work on that text."""
    server = FakeServer.vllm()
    remote = vllm_member(server, "remote", chat_template=None)
    templated = vllm_member(server, "templated", verify_mode="echo")
    assert remote.chat is None
    assert remote.probe().renders_messages
    assert remote.prompt_source == "server"
    assert remote.modes == ("completions", "logprobs")
    assert remote.score_path == "prompt_tail"
    start = len(server.calls)
    session = remote.open(SessionRequest(QUESTION))
    rendering = server.calls[start:]
    assert [path for path, _ in rendering] == ["/tokenize", "/detokenize"]
    assert rendering[0][1]["messages"] == QUESTION
    assert rendering[0][1]["add_generation_prompt"] is True
    local = templated.open(SessionRequest(QUESTION))
    assert session.prompt == local.prompt == render_messages(QUESTION)
    assert session.prompt_tokens == len(tokenize(session.prompt))  # the server counted it
    assert session.server_trace()["prompt"] == "server"

    drafted = session.draft(4, SamplingParams())
    assert drafted.text == "The capital of France"
    assert server.calls[-1][1]["prompt"] == session.prompt
    session.commit(drafted.text)
    local.commit(drafted.text)
    cands = [Candidate("a", " is Paris.", True), Candidate("b", " is Rome.", False), Candidate("c", " zzz", False)]
    assert_same_scores([session.score(cands, score_eos=True)], [local.score(cands, score_eos=True)])
    trace = session.server_trace()
    assert trace["score_path"] == "prompt_tail"
    assert trace["tail_fallbacks"] == trace["echo_fallbacks"] == 0

    result = SpecEM([remote], SpecEMConfig(segment_len=4, max_new_tokens=24)).generate(QUESTION)
    assert result.text == "The capital of France is Paris."
