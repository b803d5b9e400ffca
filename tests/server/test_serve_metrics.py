"""``GET /metrics``: Prometheus text, scraped and parsed with ``prometheus_client``'s own parser;
its values move as requests are served and errors are counted by outcome and code.

In process (Starlette's TestClient) over tiny transformers members (real tokens, a real prefix
cache) and, for the paths no real request takes on demand (a held slot, every member failing, a
member's server down), scripted members and a transport that refuses connections; in a real
``specem serve`` process over the packaged SmolLM2 for a completed and a cancelled request.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from scripted import ScriptedMember, ScriptedSession
from serve_process import ServeProcess

from specem_core import SessionRequest, SpecEM, SpecEMConfig

pytest.importorskip("prometheus_client", reason="the server extra is not installed (pip install -e '.[server]')")
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from specem_integrations.server.app import create_app

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
QUESTION = [{"role": "user", "content": "Tell me about the sea and the fish in it."}]


def parse(text: str) -> Samples:
    """Every sample of a scrape, by name and labels (the parser rejects malformed text)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"duplicated series {key}"
            samples[key] = sample.value
    return samples


def scrape(client: TestClient | httpx.Client, url: str = "/metrics", **headers: str) -> Samples:
    response = client.get(url, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


# -- values move as requests are served ------------------------------------------------------------
def test_counters_and_histograms_follow_the_requests_served(tiny_members: list[Any]) -> None:
    members = tiny_members[:2]
    names = [m.name for m in members]
    app = create_app(SpecEM(members, SpecEMConfig(max_new_tokens=6, segment_len=3)))
    with TestClient(app) as client:
        before = scrape(client)
        for outcome in ("completed", "invalid", "failed", "cancelled", "timed_out", "rejected"):
            assert value(before, "specem_requests_total", outcome=outcome) == 0  # every outcome, from the start
        for name in names:
            assert value(before, "specem_member_prompt_tokens_total", member=name) == 0
        assert value(before, "specem_ready") == 1
        assert value(before, "specem_info", model="specem", members=",".join(names), version=_version()) == 1
        assert value(before, "process_resident_memory_bytes") > 0

        traces = []
        for stream in (False, True, False):  # the third repeats the first: read from the prefix cache
            body = {"messages": QUESTION, "stream": stream, "specem": {"trace": True}}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            traces.append(_trace(response, stream))
        after = scrape(client)

    assert delta(after, before, "specem_requests_total", outcome="completed") == 3
    for name in ("specem_request_duration_seconds_count", "specem_time_to_first_segment_seconds_count"):
        assert delta(after, before, name) == 3
    assert delta(after, before, "specem_request_queue_seconds_count") == 3
    assert after[("specem_request_duration_seconds_sum", frozenset())] > 0
    assert delta(after, before, "specem_rounds_total") == sum(len(t["segments"]) for t in traces)
    for name in names:
        usage = [u for t in traces for u in t["usage"]["per_member"] if u["member"] == name]
        assert len(usage) == 3
        for kind in ("prompt", "cached", "completion", "drafted"):
            expected = sum(u[f"{kind}_tokens"] for u in usage)
            assert delta(after, before, f"specem_member_{kind}_tokens_total", member=name) == expected, kind
        wins = sum(t["wins"].get(name, 0) for t in traces)
        assert delta(after, before, "specem_member_rounds_won_total", member=name) == wins
    assert sum(delta(after, before, "specem_member_cached_tokens_total", member=n) for n in names) > 0
    assert value(after, "specem_requests_running") == 0
    assert value(after, "specem_sessions_open") == 0


def _trace(response: httpx.Response, stream: bool) -> dict[str, Any]:
    if not stream:
        trace: dict[str, Any] = response.json()["specem"]
        return trace
    import json

    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    finals = [e["specem"] for e in events if "specem" in e and "segments" in e["specem"]]
    assert finals, "no final trace in the stream"
    return dict(finals[-1])


def _version() -> str:
    from specem_core import __version__

    return __version__


# -- errors by outcome and code --------------------------------------------------------------------
class _Gate:
    """Holds every draft until released: a request that keeps its slot as long as the test wants."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()


class _HeldSession(ScriptedSession):
    def draft(self, max_tokens: int, sampling: Any, **kwargs: Any) -> Any:
        gate: _Gate = getattr(self.member, "gate")  # noqa: B009
        gate.entered.set()
        assert gate.release.wait(30), "the test never released the draft"
        return super().draft(max_tokens, sampling, **kwargs)


class _HeldMember(ScriptedMember):
    def open(self, request: SessionRequest) -> ScriptedSession:
        self.calls.append("open")
        return _HeldSession(self, request)


def _held(name: str) -> Any:
    member = _HeldMember(name, drafts=[("one two", True)])
    member.gate = _Gate()  # type: ignore[attr-defined]
    return member


def test_errors_are_counted_by_outcome_and_code() -> None:
    member = _held("held")
    app = create_app(SpecEM([member], SpecEMConfig(max_new_tokens=4)), max_concurrency=1, queue=1)
    statuses: list[int] = []
    with TestClient(app) as client:
        before = scrape(client)
        # 4xx before any model work: invalid, by code
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        assert client.post("/v1/chat/completions", json={"model": "gpt-x", "messages": QUESTION}).status_code == 404

        # one request holds the only slot, one waits in the queue, the next is refused (429)
        def ask() -> None:
            statuses.append(client.post("/v1/chat/completions", json={"messages": QUESTION}).status_code)

        runners = [threading.Thread(target=ask) for _ in range(2)]
        runners[0].start()
        assert member.gate.entered.wait(30)
        runners[1].start()
        deadline = time.monotonic() + 30
        during = scrape(client)
        while value(during, "specem_requests_queued") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
            during = scrape(client)
        assert value(during, "specem_requests_running") == 1
        assert value(during, "specem_requests_queued") == 1
        assert value(during, "specem_sessions_open") == 1
        assert value(during, "specem_engine_workers") == 1
        refused = client.post("/v1/chat/completions", json={"messages": QUESTION})
        assert refused.status_code == 429
        member.gate.release.set()
        for runner in runners:
            runner.join(30)
        after = scrape(client)
    assert statuses == [200, 200]
    changes = {
        o: delta(after, before, "specem_requests_total", outcome=o)
        for o in ("completed", "invalid", "failed", "cancelled", "timed_out", "rejected")
    }
    assert changes == {"completed": 2, "invalid": 2, "failed": 0, "cancelled": 0, "timed_out": 0, "rejected": 1}
    for code in ("invalid_value", "model_not_found", "queue_full"):
        assert delta(after, before, "specem_request_errors_total", code=code) == 1, code
    assert delta(after, before, "specem_request_queue_seconds_count") == 2  # only the requests that got a slot
    assert value(after, "specem_requests_running") == 0
    assert value(after, "specem_requests_queued") == 0


def test_a_timeout_and_members_that_all_fail_are_counted_with_their_exclusions() -> None:
    held = _held("slow")
    timed = create_app(SpecEM([held], SpecEMConfig(max_new_tokens=4)), request_timeout=0.3)
    broken = [
        ScriptedMember("a", drafts=[("x", True)], fail_on={"draft"}, concurrency_key="a"),
        ScriptedMember("b", drafts=[("y", True)], fail_on={"open"}, concurrency_key="b"),
    ]
    failing = create_app(SpecEM(broken, SpecEMConfig(max_new_tokens=4, member_retries=0)))
    with TestClient(timed) as client:
        response = client.post("/v1/chat/completions", json={"messages": QUESTION})
        held.gate.release.set()
        assert response.status_code == 504
        timed_samples = scrape(client)
    with TestClient(failing) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={"messages": QUESTION, "stream": stream})
            assert response.status_code == 500  # no segment was made: the stream had not started
            assert response.json()["error"]["code"] == "all_members_failed"
        failed_samples = scrape(client)

    assert value(timed_samples, "specem_requests_total", outcome="timed_out") == 1
    assert value(timed_samples, "specem_request_errors_total", code="request_timeout") == 1
    assert value(failed_samples, "specem_requests_total", outcome="failed") == 2
    assert value(failed_samples, "specem_request_errors_total", code="all_members_failed") == 2
    assert value(failed_samples, "specem_member_exclusions_total", member="a", stage="draft") == 2
    assert value(failed_samples, "specem_member_exclusions_total", member="b", stage="open") == 2
    # each app counts only its own requests: two registries, no shared series
    assert value(timed_samples, "specem_requests_total", outcome="failed") == 0
    assert value(failed_samples, "specem_requests_total", outcome="timed_out") == 0


# -- circuit breakers of server members --------------------------------------------------------------
def test_a_member_whose_server_is_down_shows_its_open_breaker_and_exclusions(tiny_members: list[Any]) -> None:
    from specem_core.backends.http.client import BreakerPolicy, RetryPolicy
    from specem_core.backends.http.member import OpenAIHTTPMember

    def refused(request: httpx.Request) -> httpx.Response:  # fault injection: nothing listens
        raise httpx.ConnectError("connection refused", request=request)

    remote = OpenAIHTTPMember(
        "http://127.0.0.1:9/v1",
        name="remote",
        chat_template="{{ messages }}",
        transport=httpx.MockTransport(refused),
        retry=RetryPolicy(max_retries=0, backoff_base=0.001, backoff_max=0.001),
        breaker=BreakerPolicy(failures_to_open=2, cool_down=600.0, max_cool_down=600.0),
    )
    local = tiny_members[0]
    app = create_app(SpecEM([local, remote], SpecEMConfig(max_new_tokens=4, member_retries=0)))
    with TestClient(app) as client:
        for _ in range(3):
            response = client.post("/v1/chat/completions", json={"messages": QUESTION})
            assert response.status_code == 200, response.text  # the local member answers alone
        samples = scrape(client)
    server = "http://127.0.0.1:9"
    assert value(samples, "specem_member_breaker_state", member="remote", server=server, state="open") == 1
    assert value(samples, "specem_member_breaker_state", member="remote", server=server, state="closed") == 0
    assert value(samples, "specem_member_breaker_opened_total", member="remote", server=server) == 1
    assert value(samples, "specem_member_breaker_rejected_total", member="remote", server=server) >= 1
    assert value(samples, "specem_member_exclusions_total", member="remote", stage="open") == 3
    assert not any(key[0] == "specem_member_breaker_state" and ("member", local.name) in key[1] for key in samples)


def test_how_each_server_member_verifies_is_a_metric(tiny_members: list[Any]) -> None:
    """A server member whose verification fell back to the judge (no exact scoring path) shows it,
    never silently: ``specem_member_verification{verification="judge"}``; local members have none."""
    import json

    from fake_openai_server import FakeServer

    from specem_core.backends.http.client import RetryPolicy
    from specem_core.backends.http.member import OpenAIHTTPMember

    inner = FakeServer(dialect="vllm").handler

    def no_echo(request: httpx.Request) -> httpx.Response:  # a server that refuses echo log-probs
        path = request.url.path
        completions = path.endswith("/completions") and not path.endswith("chat/completions")
        if completions and json.loads(request.content).get("echo"):
            return httpx.Response(400, json={"error": "echo is not supported"})
        return inner(request)

    remote = OpenAIHTTPMember(
        "http://x/v1",
        name="remote",
        chat_template="{{ messages }}",
        transport=httpx.MockTransport(no_echo),
        retry=RetryPolicy(max_retries=0, backoff_base=0.001, backoff_max=0.001),
    )
    local = tiny_members[0]
    with TestClient(create_app(SpecEM([local, remote], SpecEMConfig(max_new_tokens=4)))) as client:
        samples = scrape(client)
    assert value(samples, "specem_member_verification", member="remote", verification="judge") == 1
    assert not any(key[0] == "specem_member_verification" and ("member", local.name) in key[1] for key in samples)


# -- auth and formats --------------------------------------------------------------------------------
def test_metrics_need_the_api_key_unless_public(tiny_members: list[Any]) -> None:
    engine = SpecEM(tiny_members[:1], SpecEMConfig(max_new_tokens=2))
    guarded = create_app(engine, api_key="sk-metrics-SECRET")
    public = create_app(engine, api_key="sk-metrics-SECRET", metrics_public=True)
    with TestClient(guarded) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/metrics", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        samples = scrape(client, Authorization="Bearer sk-metrics-SECRET")
        assert client.get("/health").json()["requests"]["received"] == 0  # a scrape is no request
    assert value(samples, "specem_requests_total", outcome="invalid") == 0
    with TestClient(public) as client:
        scrape(client)
        assert client.get("/v1/models").status_code == 401  # the API itself still needs the key


def test_openmetrics_when_the_scraper_asks_for_it(tiny_members: list[Any]) -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    app = create_app(SpecEM(tiny_members[:1], SpecEMConfig(max_new_tokens=2)))
    with TestClient(app) as client:
        response = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    names = {family.name for family in openmetrics_families(response.text)}
    assert {"specem_requests", "specem_time_to_first_segment_seconds", "specem_requests_queued"} <= names


# -- a real server process -------------------------------------------------------------------------
@pytest.fixture
def idle(open_server: ServeProcess) -> ServeProcess:
    open_server.wait_idle(60)
    return open_server


def test_a_real_server_counts_a_completed_and_a_cancelled_request(idle: ServeProcess) -> None:
    server = idle
    member = server.health()["members"][0]
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = scrape(client)
        body = {"model": "specem", "messages": QUESTION, "max_tokens": 8, "specem": {"trace": True}}
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["specem"]["usage"]["per_member"][0]
        long = {"model": "specem", "messages": QUESTION, "max_tokens": 4000, "stream": True}
        long["specem"] = {"ignore_eos": True, "segment_len": 3}
        with client.stream("POST", "/v1/chat/completions", json=long) as stream:
            assert stream.status_code == 200
            next(line for line in stream.iter_lines() if '"content":"' in line and '"content":""' not in line)
        server.wait_idle(60)
        deadline = time.monotonic() + 30
        after = scrape(client)
        while delta(after, before, "specem_requests_total", outcome="cancelled") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            after = scrape(client)
    assert delta(after, before, "specem_requests_total", outcome="completed") == 1
    assert delta(after, before, "specem_requests_total", outcome="cancelled") == 1
    assert delta(after, before, "specem_member_prompt_tokens_total", member=member) == usage["prompt_tokens"]
    assert delta(after, before, "specem_member_completion_tokens_total", member=member) == usage["completion_tokens"]
    assert delta(after, before, "specem_time_to_first_segment_seconds_count") == 2  # both got a first segment
    assert delta(after, before, "specem_request_duration_seconds_count") == 1  # only the completed one
    assert value(after, "specem_requests_running") == 0
