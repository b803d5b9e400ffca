"""Real faults of server members, through the Python API and ``ChatSpecEM``: two real
llama-cpp-python servers (the packaged SmolLM2-135M GGUF twice: the 0.5B Qwen's probes take half
a minute on two shared cores) and one in-process llama.cpp member; a server is SIGKILLed while an
answer streams, restarted on the same port, or every server is down. No mocks: processes on
loopback.

The circuit breaker (``BreakerPolicy``) is per server URL and shared by every client of it, so the
tests here, which restart servers on the same ports, leave each server up and answered before they
end (``_back``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from llama_server import LlamaServer, llama_cpp_available, start_server

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import SamplingParams, SessionRequest
from specem_core.backends.http.client import BreakerPolicy, RetryPolicy
from specem_core.backends.http.errors import ServerUnavailableError
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.errors import AllMembersFailedError
from specem_core.registry import load_member, resolve_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not llama_cpp_available(),
        reason="llama-cpp-python[server] is not installed (scripts/build_llama_cpp.sh builds and installs it)",
    ),
]

STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
TIMEOUT = 30.0
"""Each member request's timeout (connect included; generous: the probes run on shared cores)."""
RETRY = RetryPolicy(max_retries=3, backoff_base=5.0, backoff_max=20.0)
"""Without a breaker a dead server would cost at least 2.5 + 5 + 10 s of backoff per call (more
than TIMEOUT / 2)."""
BREAKER = BreakerPolicy(failures_to_open=2, cool_down=15.0, max_cool_down=30.0)
"""Long enough that the checks made while a server is down all fall within one cool-down."""
CONFIG = SpecEMConfig(segment_len=4, max_new_tokens=48, temperature=0.0, ignore_eos=True, member_retries=1, seed=7)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, LlamaServer]]:
    started: dict[str, LlamaServer] = {}
    try:
        started["smol-a"] = start_server("smollm2", alias="smol-a")
        started["smol-b"] = start_server("smollm2", alias="smol-b")
        yield started
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def local() -> Any:
    return load_member("smollm2", backend="llamacpp", name="smol-local")


@pytest.fixture(scope="module")
def members(servers: dict[str, LlamaServer]) -> tuple[OpenAIHTTPMember, OpenAIHTTPMember]:
    """The two server members, probed once while their servers are up (the tests reuse them)."""
    a, b = http_member(servers["smol-a"], "smollm2"), http_member(servers["smol-b"], "smollm2")
    a.probe()
    b.probe()
    return a, b


def http_member(server: LlamaServer, tokenizer: str) -> OpenAIHTTPMember:
    return OpenAIHTTPMember(
        server.base_url,
        server.alias,
        name=server.alias,
        tokenizer=resolve_tokenizer(tokenizer),
        timeout=TIMEOUT,
        retry=RETRY,
        breaker=BREAKER,
    )


def kill(servers: dict[str, LlamaServer], name: str) -> None:
    servers[name].process.kill()  # SIGKILL: no goodbye to open connections
    servers[name].process.wait(timeout=10)


def restart(servers: dict[str, LlamaServer], name: str, model: str) -> None:
    old = servers[name]
    servers[name] = start_server(model, alias=name, port=old.port)


TRANSPORT = re.compile(
    r"\b(ConnectError|ConnectTimeout|ReadError|ReadTimeout|WriteError|WriteTimeout|PoolTimeout|CloseError"
    r"|RemoteProtocolError)\b"
)
"""httpx's transport failures: what a server killed under a request leaves its client with."""


def transport_failure(error: str) -> bool:
    """An exclusion's error as a dead server leaves it, and nothing else: the HTTP member's own typed
    error (its retries spent, or its circuit breaker opening or open) over an httpx transport failure.
    Not any text with "Error" in it: a ``KeyError`` or ``ServerResponseError`` is a different fault."""
    return bool(re.match(r"(HTTPMemberError|ServerUnavailableError): ", error)) and bool(TRANSPORT.search(error))


def _back(member: OpenAIHTTPMember) -> None:
    """Wait out the breaker's cool-down so that the next request probes the restarted server."""
    deadline = time.monotonic() + 2 * BREAKER.max_cool_down
    while member.client.breaker.state == "open" and time.monotonic() < deadline:
        time.sleep(0.1)


def test_member_killed_mid_answer_completes_from_the_others_through_chatspecem(
    servers: dict[str, LlamaServer], members: tuple[OpenAIHTTPMember, OpenAIHTTPMember], local: Any
) -> None:
    from langchain_core.messages import AIMessageChunk

    from specem_integrations.langchain import ChatSpecEM

    a, b = members
    llm = ChatSpecEM(engine=SpecEM([a, b, local], CONFIG))
    chunks: list[AIMessageChunk] = []
    try:
        for chunk in llm.stream(STORY[0]["content"]):
            chunks.append(chunk)
            if len(chunks) == 1:
                assert chunk.content  # a first segment was streamed: the answer is under way
                kill(servers, "smol-a")
    finally:
        if servers["smol-a"].process.poll() is not None:
            restart(servers, "smol-a", "smollm2")
    final = chunks[-1]
    trace = final.response_metadata["specem"]
    excluded = [e for e in trace["excluded"] if e["member"] == "smol-a"]
    assert len(excluded) == 1, trace["excluded"]
    assert excluded[0]["stage"] in ("draft", "score", "commit")
    assert excluded[0]["round"] >= 2  # after the first streamed segment, not at the start
    assert transport_failure(excluded[0]["error"]), excluded[0]
    assert [e["member"] for e in trace["excluded"]] == ["smol-a"]
    streamed = "".join(str(c.content) for c in chunks)
    # Nothing lost or repeated: the streamed text is exactly the committed segments, in order.
    assert streamed == "".join(s["text"] for s in trace["segments"])
    assert final.response_metadata["finish_reason"] == "length"  # ran to max_new_tokens from the others
    later = trace["segments"][excluded[0]["round"] :]
    assert later
    assert all(s["winner"] in ("smol-b", "smol-local") for s in later)
    assert all("smol-a" not in s["drafters"] for s in later)
    _back(a)


def test_server_down_is_skipped_at_once_then_used_again_after_restart(
    servers: dict[str, LlamaServer], members: tuple[OpenAIHTTPMember, OpenAIHTTPMember], local: Any
) -> None:
    a, b = members
    engine = SpecEM([a, b, local], CONFIG.replace(max_new_tokens=12))
    first = engine.generate(STORY)
    assert first.excluded == []
    kill(servers, "smol-a")
    try:
        down = engine.generate(STORY)  # the first request after the kill finds the server down
        assert [e.member for e in down.excluded] == ["smol-a"]
        assert transport_failure(down.excluded[0].error), down.excluded[0]
        assert a.client.breaker.state != "closed"
        # While open: no connection attempt, no retry, no backoff (RETRY's backoff alone would take
        # more than TIMEOUT / 2). Once the cool-down is over (a slow machine): one probe, refused.
        session = a.open(SessionRequest(STORY))
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="circuit"):
            session.draft(4, SamplingParams())
        assert time.monotonic() - started < TIMEOUT / 2
        session.close()
        skipped = engine.generate(STORY)
        assert [e.member for e in skipped.excluded] == ["smol-a"]
        assert "ServerUnavailableError" in skipped.excluded[0].error
        assert "circuit" in skipped.excluded[0].error
        assert transport_failure(skipped.excluded[0].error), skipped.excluded[0]
        assert skipped.text
    finally:
        restart(servers, "smol-a", "smollm2")
    _back(a)  # the cool-down (BREAKER.cool_down) passes; the next request is the probe
    again = engine.generate(STORY)  # the same engine: nothing rebuilt
    assert again.excluded == []
    assert a.client.breaker.state == "closed"
    assert any("smol-a" in s.drafters for s in again.segments)


def test_all_members_down_fails_clearly_then_recovers(
    servers: dict[str, LlamaServer], members: tuple[OpenAIHTTPMember, OpenAIHTTPMember]
) -> None:
    a, b = members
    engine = SpecEM([a, b], CONFIG.replace(max_new_tokens=8))
    assert engine.generate(STORY).excluded == []  # probed while up
    kill(servers, "smol-a")
    kill(servers, "smol-b")
    try:
        started = time.monotonic()
        with pytest.raises(AllMembersFailedError) as info:
            engine.generate(STORY)
        assert time.monotonic() - started < 2 * TIMEOUT  # retries bounded, then the breakers open
        message = str(info.value)
        assert "smol-a" in message
        assert "smol-b" in message
    finally:
        restart(servers, "smol-a", "smollm2")
        restart(servers, "smol-b", "smollm2")
    _back(a)
    _back(b)
    result = engine.generate(STORY)
    assert result.text
    assert result.excluded == []
