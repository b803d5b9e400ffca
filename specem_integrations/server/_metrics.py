"""Prometheus metrics of one ``specem serve`` app (``GET /metrics``), in the app's own registry.

Counters and histograms are updated as requests end; gauges (load, readiness, circuit breakers,
member weights) are read from the live server at each scrape. Each app has its own
:class:`~prometheus_client.CollectorRegistry`, so several apps in one process (tests, an app
mounted twice) never share or collide on a series. The names, what they count and what to alert
on: ``docs/guides/deploying.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from specem_core import __version__
from specem_core.backends.base import Breaker
from specem_core.types import GenerationResult

OUTCOMES = ("completed", "invalid", "failed", "cancelled", "timed_out", "rejected")
"""How a chat-completion request ended (the ``outcome`` label; the ``/health`` counters' names):
answered (``completed``), 4xx for the request (``invalid``), 5xx (``failed``), the client went away
or the server shut down first (``cancelled``), 504 (``timed_out``), 429 queue full (``rejected``)."""

BREAKER_STATES = ("closed", "half_open", "open")
INFO_LABELS = ["model", "members", "version"]

QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FIRST_SEGMENT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
DURATION_BUCKETS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
"""Seconds; wide because one CPU answer takes seconds and a queued one minutes (a GPU's fall in
the low buckets)."""


@dataclass
class LiveState:
    """What the gauges show, read from the server at each scrape."""

    running: int
    queued: int
    max_concurrency: int
    queue: int
    sessions_open: int | None
    engine_workers: int
    ready: bool
    draining: bool
    breakers: list[tuple[str, Breaker]] = field(default_factory=list)
    """``(member, breaker)`` for members reached over HTTP
    (:class:`~specem_core.backends.base.BreakerMember`: ``key``, ``state``, ``opened``,
    ``rejected``); local members have none."""
    weights: Mapping[str, float] = field(default_factory=dict)
    """The member weights' current normalized values (empty without member weights)."""
    verification: list[tuple[str, str]] = field(default_factory=list)
    """``(member, how it verifies)`` for members whose way is decided from their server
    (:class:`~specem_core.backends.base.VerificationMember`: ``exact``, ``judge``, ``none``)."""


class _LiveCollector(Collector):
    def __init__(self, read: Callable[[], LiveState], model: str, members: Sequence[str]) -> None:
        self._read = read
        self._model = model
        self._members = list(members)

    def collect(self) -> Iterable[Metric]:
        live = self._read()
        gauges: list[tuple[str, str, float | None]] = [
            ("specem_requests_running", "Requests holding a slot (running the ensemble) now.", live.running),
            ("specem_requests_queued", "Requests waiting for a slot now (the queue depth).", live.queued),
            ("specem_max_concurrency", "Requests that may run at once (--max-concurrency).", live.max_concurrency),
            ("specem_queue_capacity", "Requests that may wait for a slot (--queue); beyond: 429.", live.queue),
            ("specem_sessions_open", "Member sessions open (one per member per running request).", live.sessions_open),
            ("specem_engine_workers", "Engine worker threads alive (one per request).", live.engine_workers),
            ("specem_ready", "1 while /health/ready answers 200 (members probed, not draining).", int(live.ready)),
            ("specem_draining", "1 once shutdown has begun (SIGTERM / SIGINT).", int(live.draining)),
        ]  # fmt: skip
        for name, documentation, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=value)
        info = GaugeMetricFamily(
            "specem_info", "The served model id, its members and SpecEM's version (value 1).", labels=INFO_LABELS
        )
        info.add_metric([self._model, ",".join(self._members), __version__], 1)
        yield info
        if live.weights:
            weight = GaugeMetricFamily(
                "specem_member_weight", "A member's verifier weight now (normalized).", labels=["member"]
            )
            for member, value in live.weights.items():
                weight.add_metric([member], value)
            yield weight
        if live.verification:
            verifies = GaugeMetricFamily(
                "specem_member_verification",
                "How a server member verifies (value 1): exact (a scoring path), judge (approximate) or none.",
                labels=["member", "verification"],
            )
            for member, how in live.verification:
                verifies.add_metric([member, how], 1)
            yield verifies
        if live.breakers:
            yield from _breaker_metrics(live.breakers)


def _breaker_metrics(breakers: Sequence[tuple[str, Breaker]]) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "specem_member_breaker_state",
        "Circuit breaker of a member's server: 1 on the state it is in (closed, half_open, open), 0 on the others.",
        labels=["member", "server", "state"],
    )
    opened = CounterMetricFamily(
        "specem_member_breaker_opened",
        "Times a member's server's breaker opened (a failed probe counts again).",
        labels=["member", "server"],
    )
    refused = CounterMetricFamily(
        "specem_member_breaker_rejected",
        "Calls to a member's server refused at once while its breaker was open.",
        labels=["member", "server"],
    )
    for member, breaker in breakers:
        current = str(breaker.state)
        for name in BREAKER_STATES:
            state.add_metric([member, breaker.key, name], 1 if current == name else 0)
        opened.add_metric([member, breaker.key], breaker.opened)
        refused.add_metric([member, breaker.key], breaker.rejected)
    yield state
    yield opened
    yield refused


class ServerMetrics:
    """The metrics of one app: its registry, what requests update, and the scrape.

    Args:
        read: returns the live state (called at each scrape, on the event loop).
        model: the served model id.
        members: the members' names (their series start at 0).
    """

    def __init__(self, read: Callable[[], LiveState], model: str, members: Sequence[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "specem_requests",
            "Chat-completion requests by how they ended: completed, invalid (4xx), failed (5xx), "
            "cancelled (client gone, or shutdown), timed_out (504), rejected (429, queue full).",
            ["outcome"],
            registry=r,
        )
        self.errors = Counter(
            "specem_request_errors",
            "Error answers by their OpenAI error code (a status, or an error event inside a stream).",
            ["code"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "specem_request_queue_seconds",
            "Seconds from a request's arrival to its slot (requests that got one).",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.first_segment_seconds = Histogram(
            "specem_time_to_first_segment_seconds",
            "Seconds from a request's arrival (queue wait included) to its first committed segment.",
            buckets=FIRST_SEGMENT_BUCKETS,
            registry=r,
        )
        self.duration_seconds = Histogram(
            "specem_request_duration_seconds",
            "Seconds from a request's arrival to the end of its answer (completed requests).",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.rounds = Counter("specem_rounds", "Rounds (committed segments) of completed requests.", registry=r)
        by_member = ["member"]
        self.prompt_tokens = Counter(
            "specem_member_prompt_tokens", "Prompt tokens, in each member's own tokens.", by_member, registry=r
        )
        self.cached_tokens = Counter(
            "specem_member_cached_tokens",
            "Prompt tokens a member read from its prefix cache instead of prefilling them.",
            by_member,
            registry=r,
        )
        self.completion_tokens = Counter(
            "specem_member_completion_tokens",
            "Committed answer tokens, in each member's own tokens.",
            by_member,
            registry=r,
        )
        self.drafted_tokens = Counter(
            "specem_member_drafted_tokens",
            "Tokens a member generated while drafting (won or not).",
            by_member,
            registry=r,
        )
        self.rounds_won = Counter(
            "specem_member_rounds_won", "Rounds whose committed segment was this member's draft.", by_member, registry=r
        )
        self.exclusions = Counter(
            "specem_member_exclusions",
            "Members dropped from a request, by stage: open, draft, score, commit (failed after retries) "
            "or gate (kept out by the learned weights).",
            ["member", "stage"],
            registry=r,
        )
        for outcome in OUTCOMES:  # every outcome shows, at 0, from the first scrape
            self.requests.labels(outcome)
        for name in members:
            for counter in (
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
                self.drafted_tokens,
                self.rounds_won,
            ):
                counter.labels(name)
        r.register(_LiveCollector(read, model, members))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self._exposed = _WithoutCreated(r)

    # -- updates -------------------------------------------------------------------------------
    def count(self, outcome: str) -> None:
        """One request ended with ``outcome`` (one of :data:`OUTCOMES`)."""
        self.requests.labels(outcome).inc()

    def error(self, code: str | None) -> None:
        """An error answer (its OpenAI code)."""
        self.errors.labels(code or "none").inc()

    def queued(self, seconds: float) -> None:
        """A request got its slot after ``seconds``."""
        self.queue_seconds.observe(max(0.0, seconds))

    def first_segment(self, seconds: float) -> None:
        """A request's first segment came ``seconds`` after its arrival."""
        self.first_segment_seconds.observe(max(0.0, seconds))

    def completed(self, result: GenerationResult, seconds: float) -> None:
        """A request completed ``seconds`` after its arrival: its duration, tokens, rounds, wins and exclusions."""
        self.duration_seconds.observe(max(0.0, seconds))
        self.rounds.inc(len(result.segments))
        for usage in result.usage.per_member:
            self.prompt_tokens.labels(usage.member).inc(_count(usage.prompt_tokens))
            self.cached_tokens.labels(usage.member).inc(_count(usage.cached_tokens))
            self.completion_tokens.labels(usage.member).inc(_count(usage.completion_tokens))
            self.drafted_tokens.labels(usage.member).inc(_count(usage.drafted_tokens))
        for member, wins in result.wins.items():
            if wins:
                self.rounds_won.labels(member).inc(wins)
        self.excluded(result.excluded)

    def excluded(self, exclusions: Iterable[Any]) -> None:
        """Members dropped from a request (:class:`~specem_core.types.Exclusion`: member, stage)."""
        for exclusion in exclusions:
            self.exclusions.labels(str(exclusion.member), str(exclusion.stage)).inc()

    # -- the scrape ----------------------------------------------------------------------------
    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition (Prometheus text, or OpenMetrics when ``accept`` asks for it) and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self._exposed), content_type


class _WithoutCreated(Collector):
    """The registry's metrics less the ``*_created`` samples (each counter's and histogram's
    creation time): Prometheus does not use them, and in the text format they double the page."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def _count(value: object) -> float:
    """A token count as a counter increment (never negative, never NaN)."""
    number = float(value) if isinstance(value, int | float) else 0.0
    return number if math.isfinite(number) and number > 0 else 0.0
