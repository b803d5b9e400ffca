"""The probe asks only what a request will use, once per server: a member alone never asks how its
server scores, a second member (or a new process, through the disk cache) asks nothing the first
asked, and a cached scoring path the server no longer offers is probed again, not lost.

The fake vLLM server of ``fake_openai_server.py`` answers; every request is counted by method and
path (:class:`Counting`). The real servers' probe costs are ``benchmarks/multiturn_servers.py``'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai_server import FakeServer
from test_openai_http import CHATML, FAST, QUESTION

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.http import probe_cache
from specem_core.backends.http.member import OpenAIHTTPMember

URL = "http://fake.test/v1"
Override = Callable[[httpx.Request, dict[str, Any]], httpx.Response | None]
CONFIG = SpecEMConfig(segment_len=4, max_new_tokens=24)


class Counting:
    """A transport over a fake server that records ``(method, path, body)`` of every request, and
    can answer some requests itself (``override``: return a response, or ``None`` to pass on)."""

    def __init__(self, server: FakeServer, override: Override | None = None) -> None:
        self.server = server
        self.override = override
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.calls.append((request.method, request.url.path, body))
        if self.override is not None:
            answer = self.override(request, body)
            if answer is not None:
                return answer
        return self.server.handler(request)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    def posts(self) -> list[tuple[str, dict[str, Any]]]:
        return [(path, body) for method, path, body in self.calls if method == "POST"]


def scoring_requests(calls: Counting) -> list[dict[str, Any]]:
    """The requests that ask for log-probs (how a server scores), probe or scoring."""
    asks = ("echo", "logprob_token_ids", "logprobs")
    return [body for _, body in calls.posts() if any(body.get(key) for key in asks)]


def new_member(calls: Counting, name: str = "m", **kwargs: Any) -> OpenAIHTTPMember:
    kwargs.setdefault("chat_template", CHATML)
    kwargs.setdefault("end_of_turn", "<|im_end|>")
    return OpenAIHTTPMember(URL, "fake", name=name, transport=calls.transport(), retry=FAST, **kwargs)


@pytest.fixture
def disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The disk cache on, in a folder of this test's own."""
    monkeypatch.setenv("SPECEM_PROBE_CACHE", "1")
    monkeypatch.setattr(probe_cache, "directory", lambda: tmp_path / "probes")
    return tmp_path / "probes"


def test_a_member_alone_never_asks_how_its_server_scores() -> None:
    calls = Counting(FakeServer(dialect="vllm"))
    alone = new_member(calls)
    result = SpecEM([alone], CONFIG).generate(QUESTION)
    assert result.text == "The capital of France is Paris."
    assert scoring_requests(calls) == []
    assert alone.verification is None  # never asked
    assert alone.capabilities is not None
    assert not alone.capabilities.scoring_probed


def test_a_pair_asks_how_the_servers_score_at_its_first_vote() -> None:
    first, second = Counting(FakeServer(dialect="vllm")), Counting(FakeServer(dialect="vllm", answer="Paris it is."))
    members = [new_member(first, "a"), new_member(second, "b")]
    result = SpecEM(members, CONFIG).generate(QUESTION)
    assert result.text
    for member, calls in zip(members, (first, second), strict=True):
        assert member.verification == "exact"
        assert member.capabilities is not None
        assert member.capabilities.scoring_probed
        assert "echo" in member.capabilities.score_paths
        assert scoring_requests(calls)


def test_a_second_member_on_the_same_server_asks_nothing_the_first_asked() -> None:
    calls = Counting(FakeServer(dialect="vllm"))
    first = new_member(calls, "first")
    caps = first.probe()
    asked = len(calls.calls)
    second = new_member(calls, "second")
    assert second.probe() == caps
    again = calls.calls[asked:]
    assert [(method, path) for method, path, _ in again] == [("GET", "/v1/models"), ("GET", "/version")]
    assert second.verification == first.verification == "exact"
    # another prompt format is another question: asked again
    posted = len(calls.posts())
    other = new_member(calls, "other", chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}")
    other.probe()
    assert len(calls.posts()) > posted


def test_a_new_process_reads_the_probe_from_disk(disk_cache: Path) -> None:
    calls = Counting(FakeServer(dialect="vllm"))
    caps = new_member(calls, api_key="sk-secret-123").probe()
    files = list(disk_cache.glob("*.json"))
    assert len(files) == 1
    entry = files[0].read_text()
    assert "sk-secret-123" not in entry  # the key is never part of the entry
    assert json.loads(entry)["capabilities"]["score_paths"] == list(caps.score_paths)
    probe_cache.clear(disk=False)  # what a new process starts with: the files only
    fresh = Counting(FakeServer(dialect="vllm"))
    member = new_member(fresh, api_key="sk-secret-123")
    assert member.probe() == caps
    assert fresh.posts() == []
    result = SpecEM([member, new_member(fresh, "b")], CONFIG).generate(QUESTION)
    assert result.text == "The capital of France is Paris."
    assert member.verification == "exact"


def test_another_server_version_is_probed_again(disk_cache: Path) -> None:
    version = {"value": "0.32.0"}

    def versioned(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": version["value"]})
        return None

    calls = Counting(FakeServer(dialect="vllm"), versioned)
    new_member(calls).probe()
    posted = len(calls.posts())
    assert posted > 0
    new_member(calls, "same").probe()
    assert len(calls.posts()) == posted
    version["value"] = "0.33.0"
    probe_cache.clear(disk=False)
    new_member(calls, "upgraded").probe()
    assert len(calls.posts()) > posted
    assert len(list(disk_cache.glob("*.json"))) == 2


def test_a_cached_path_the_server_no_longer_offers_is_probed_again(
    disk_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache says echo; the server, restarted, refuses echo log-probs (404): the member forgets
    the entry, asks again, and verifies as the server now allows (the judge), saying so."""
    new_member(Counting(FakeServer(dialect="vllm"))).probe()
    probe_cache.clear(disk=False)

    def no_echo(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if body.get("echo"):
            return httpx.Response(404, json={"error": "echo is not supported"})
        return None

    restarted = Counting(FakeServer(dialect="vllm"), no_echo)
    member = new_member(restarted, "a")
    assert member.probe(scoring=False).score_paths == ("echo",)  # what the cache says
    with caplog.at_level(logging.WARNING, logger="specem.http"):
        result = SpecEM([member, new_member(restarted, "b")], CONFIG).generate(QUESTION)
    assert result.text
    assert not result.excluded
    assert member.verification == "judge"
    assert member.capabilities is not None
    assert member.capabilities.score_paths == ()
    assert any("probing it again" in r.getMessage() for r in caplog.records)
    probe_cache.clear(disk=False)
    assert new_member(Counting(FakeServer(dialect="vllm")), "later").probe(scoring=False).score_paths == ()


def test_an_unreadable_entry_is_probed_again(disk_cache: Path) -> None:
    calls = Counting(FakeServer(dialect="vllm"))
    caps = new_member(calls).probe()
    (entry,) = disk_cache.glob("*.json")
    entry.write_text("{not json")
    probe_cache.clear(disk=False)
    posted = len(calls.posts())
    assert new_member(calls, "again").probe() == caps
    assert len(calls.posts()) > posted
    assert json.loads(entry.read_text())["schema"] == probe_cache.SCHEMA
