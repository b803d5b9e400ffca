"""The circuit breaker of server members (``BreakerPolicy`` / ``CircuitBreaker``): its states on
a controlled clock, and the client refusing requests at once while it is open (faults injected
through a mock transport; the real-process behaviour is in ``test_http_member_faults_real.py``)."""

from __future__ import annotations

import httpx
import pytest

from specem_core.backends.http.client import BreakerPolicy, CircuitBreaker, OpenAIClient, RetryPolicy, run_sync
from specem_core.backends.http.errors import HTTPMemberError, ServerUnavailableError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_failures_in_a_row_then_probes_once_after_the_cool_down() -> None:
    clock = Clock()
    breaker = CircuitBreaker("http://s:1", BreakerPolicy(failures_to_open=3, cool_down=5.0), clock=clock)
    breaker.record_failure("refused", probe=False)
    breaker.record_failure("refused", probe=False)
    breaker.record_success()  # an answer in between: the count starts again
    for _ in range(2):
        breaker.record_failure("refused", probe=False)
    assert breaker.state == "closed"
    breaker.record_failure("ConnectError: refused", probe=False)
    assert breaker.state == "open"
    with pytest.raises(ServerUnavailableError, match=r"circuit open for http://s:1: 3 transport failures.*refused"):
        breaker.before_request()
    clock.now += 5.0
    assert breaker.state == "half_open"
    assert breaker.before_request() is True  # this request is the probe
    with pytest.raises(ServerUnavailableError, match="a probe is in flight"):
        breaker.before_request()
    breaker.record_success()
    assert breaker.state == "closed"
    assert breaker.before_request() is False
    assert breaker.rejected == 2


def test_a_failed_probe_opens_again_with_a_doubled_cool_down_up_to_the_maximum() -> None:
    clock = Clock()
    breaker = CircuitBreaker("k", BreakerPolicy(failures_to_open=1, cool_down=2.0, max_cool_down=5.0), clock=clock)
    breaker.record_failure("refused", probe=False)
    for wait in (2.0, 4.0, 5.0, 5.0):
        clock.now += wait - 0.01
        assert breaker.state == "open"
        clock.now += 0.01
        assert breaker.before_request() is True
        breaker.record_failure("refused", probe=True)
    assert breaker.opened == 5


def test_policy_values_are_checked() -> None:
    with pytest.raises(ValueError, match="failures_to_open"):
        BreakerPolicy(failures_to_open=0)
    with pytest.raises(ValueError, match="cool_down"):
        BreakerPolicy(cool_down=10.0, max_cool_down=1.0)


def test_an_open_breaker_stops_retries_and_refuses_without_touching_the_server() -> None:
    calls = {"n": 0}

    def refused(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ConnectError("connection refused", request=request)

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    transport = httpx.MockTransport(refused)
    client = OpenAIClient(
        "http://down.test/v1",
        transport=transport,
        retry=RetryPolicy(max_retries=5, backoff_base=1.0),
        breaker=BreakerPolicy(failures_to_open=2, cool_down=60.0, max_cool_down=60.0),
        sleep=sleep,
    )
    with pytest.raises(ServerUnavailableError, match="circuit now open"):
        run_sync(client.post("/completions", {}))
    assert calls["n"] == 2  # the breaker opened on the second failure: no third attempt
    assert len(slept) == 1  # and no backoff before an attempt that would be refused
    with pytest.raises(ServerUnavailableError, match="circuit open"):
        run_sync(client.post("/completions", {}))
    assert calls["n"] == 2
    # Another client of the same server over the same transport shares the breaker; another server does not.
    same = OpenAIClient("http://down.test/v1/", transport=transport, sleep=sleep)
    assert same.breaker is client.breaker
    other = OpenAIClient("http://up.test/v1", transport=transport, sleep=sleep)
    assert other.breaker is not client.breaker


def test_http_error_statuses_do_not_open_the_breaker() -> None:
    client = OpenAIClient(
        "http://busy.test/v1",
        transport=httpx.MockTransport(lambda r: httpx.Response(503, text="busy")),
        retry=RetryPolicy(max_retries=3, backoff_base=0.0),
        breaker=BreakerPolicy(failures_to_open=1),
    )
    with pytest.raises(HTTPMemberError, match="after 4 attempts"):
        run_sync(client.post("/completions", {}))
    assert client.breaker.state == "closed"


def test_shutdown_timeout_and_graceful_timeout_are_one_option() -> None:
    from specem_integrations.cli import _parser

    assert _parser().parse_args(["serve", "--shutdown-timeout", "7"]).graceful_timeout == 7.0
    assert _parser().parse_args(["serve", "--graceful-timeout", "3"]).graceful_timeout == 3.0
    assert _parser().parse_args(["serve"]).graceful_timeout == 30.0
