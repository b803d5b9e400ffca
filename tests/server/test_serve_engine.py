"""The app serves the engine it was given (no copy, no wrapped members): open sessions are counted
by an observer on that engine, engine workers are asked of it, readiness probes the members that
are :class:`~specem_core.backends.base.ProbingMember` and the metrics read the breakers of those
that are :class:`~specem_core.backends.base.BreakerMember`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from scripted import ScriptedMember

from specem_core import SpecEM, SpecEMConfig
from specem_core.backends.base import BreakerMember, Member, ProbingMember

pytest.importorskip("starlette", reason="the server extra is not installed (pip install -e '.[server]')")
from starlette.testclient import TestClient

from specem_integrations.server._readiness import Readiness
from specem_integrations.server.app import create_app

MESSAGES = [{"role": "user", "content": "hi"}]


def _engine(*members: Member) -> SpecEM:
    return SpecEM(list(members) or [ScriptedMember("a", drafts=[("hello", True)])], SpecEMConfig(max_new_tokens=8))


def test_the_given_engine_is_served_and_its_sessions_counted() -> None:
    engine = _engine()
    app = create_app(engine)
    server = app.state.specem
    assert server.engine is engine
    assert server.engine.members[0] is engine.members[0]  # no wrapper around the member
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert answer.status_code == 200, answer.text
        streamed = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
        assert streamed.status_code == 200
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert (health["sessions_open"], health["sessions_opened_total"]) == (0, 2)
    assert health["engine_workers"] == engine.active_workers == 0
    assert "specem_sessions_open 0.0" in metrics


def test_without_session_counting_no_observer_is_registered() -> None:
    engine = _engine()
    app = create_app(engine, count_sessions=False)
    assert len(engine._observers) == 0
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json={"messages": MESSAGES}).status_code == 200
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert health["sessions_open"] is None
    assert health["sessions_opened_total"] is None
    assert "specem_sessions_open" not in metrics


@dataclass
class _Probed(ScriptedMember):
    probe_error: str = ""
    probes: int = 0
    scoring: list[bool] = field(default_factory=list)

    def probe(self, *, scoring: bool = True) -> object:
        self.probes += 1
        self.scoring.append(scoring)
        if self.probe_error:
            raise ConnectionError(self.probe_error)
        return {}


def test_readiness_probes_the_probing_members_only() -> None:
    plain = ScriptedMember("plain", drafts=[("x", True)])
    remote = _Probed("remote", drafts=[("x", True)])
    down = _Probed("down", drafts=[("x", True)], can_draft=False, probe_error="refused\nmore")
    assert isinstance(remote, ProbingMember)
    assert not isinstance(plain, ProbingMember)
    readiness = Readiness([plain, remote, down])
    assert readiness.members() == {"plain": "ok", "remote": "probing", "down": "probing"}
    readiness._probe_all()
    assert readiness.members() == {"plain": "ok", "remote": "ok", "down": "ConnectionError: refused"}
    assert readiness.ready
    assert (remote.probes, down.probes) == (1, 1)
    assert remote.scoring == [True]  # plain and remote draft: they vote, so how servers score is asked
    alone = _Probed("alone", drafts=[("x", True)])
    Readiness([alone])._probe_all()
    assert alone.scoring == [False]  # a member alone never scores


class _Breaker:
    key = "http://down.test"
    state = "open"
    opened = 3
    rejected = 7


@dataclass
class _Guarded(ScriptedMember):
    @property
    def breaker(self) -> Any:
        return _Breaker()


def test_the_metrics_show_the_breakers_of_breaker_members() -> None:
    guarded = _Guarded("guarded", drafts=[("x", True)])
    assert isinstance(guarded, BreakerMember)
    app = create_app(_engine(guarded, ScriptedMember("local", drafts=[("x", True)])))
    with TestClient(app) as client:
        metrics = client.get("/metrics").text
    assert 'specem_member_breaker_state{member="guarded",server="http://down.test",state="open"} 1.0' in metrics
    assert 'specem_member_breaker_rejected_total{member="guarded",server="http://down.test"} 7.0' in metrics
    breaker_lines = [line for line in metrics.splitlines() if line.startswith("specem_member_breaker")]
    assert breaker_lines
    assert not any('member="local"' in line for line in breaker_lines)
