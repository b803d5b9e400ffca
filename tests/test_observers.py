"""Engine observers (:mod:`specem_core.observers`): every session opened is reported closed once,
every member call is reported with its stage, round, attempt, time and error, an observer that
raises never fails a request, and an engine without observers wraps no call."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter

import pytest
from scripted import ScriptedMember

from specem_core import SpecEM, SpecEMConfig
from specem_core.errors import AllMembersFailedError, InputError
from specem_core.member_calls import MemberCalls
from specem_core.observers import MemberCall, MemberObserver, Observers


class Recorder(MemberObserver):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self.calls: list[MemberCall] = []

    def session_opened(self, member: str) -> None:
        with self.lock:
            self.opened[member] += 1

    def session_closed(self, member: str) -> None:
        with self.lock:
            self.closed[member] += 1

    def call_finished(self, call: MemberCall) -> None:
        with self.lock:
            self.calls.append(call)


def _pair(**config: object) -> tuple[SpecEM, ScriptedMember, ScriptedMember]:
    a = ScriptedMember("a", drafts=[("one ", False), ("two ", False), ("end", True)])
    b = ScriptedMember("b", drafts=[("uno ", False), ("dos ", False), ("fin", True)])
    return SpecEM([a, b], SpecEMConfig(max_new_tokens=32, **config)), a, b  # type: ignore[arg-type]


def test_every_session_and_call_is_reported() -> None:
    engine, a, b = _pair()
    recorder = Recorder()
    engine.add_observer(recorder)
    result = engine.generate("q")
    assert recorder.opened == Counter({"a": 1, "b": 1})
    assert recorder.closed == recorder.opened
    by_stage = Counter((c.member, c.stage) for c in recorder.calls)
    for member in (a, b):
        for stage in ("open", "draft", "score", "commit"):
            assert by_stage[(member.name, stage)] == member.calls.count(stage), (member.name, stage)
    rounds = len(result.segments)
    assert {c.round for c in recorder.calls if c.stage == "draft"} == set(range(1, rounds + 1))
    assert all(c.round == 0 for c in recorder.calls if c.stage == "open")
    assert all(c.error is None and c.attempt == 0 and c.seconds >= 0 for c in recorder.calls)
    assert all(c.ended == c.started + c.seconds for c in recorder.calls)


def test_retries_errors_and_exclusions_are_reported() -> None:
    bad = ScriptedMember("bad", drafts=[("x", True)], fail_on={"draft"})
    good = ScriptedMember("good", drafts=[("fine", True)])
    recorder = Recorder()
    result = SpecEM([bad, good], SpecEMConfig(max_new_tokens=8, member_retries=2), observers=[recorder]).generate("q")
    assert [e.member for e in result.excluded] == ["bad"]
    drafts = [c for c in recorder.calls if c.member == "bad" and c.stage == "draft"]
    assert [c.attempt for c in drafts] == [0, 1, 2]
    assert all(isinstance(c.error, TimeoutError) for c in drafts)
    assert recorder.closed == recorder.opened == Counter({"bad": 1, "good": 1})  # the excluded one too


def test_a_failed_open_is_no_session() -> None:
    good = ScriptedMember("good", drafts=[("fine", True)])
    gone = ScriptedMember("gone", drafts=[("x", True)], fail_on={"open"})
    recorder = Recorder()
    SpecEM([good, gone], SpecEMConfig(max_new_tokens=8, member_retries=0), observers=[recorder]).generate("q")
    assert recorder.opened == recorder.closed == Counter({"good": 1})
    assert [c.member for c in recorder.calls if c.stage == "open" and c.error is not None] == ["gone"]


def test_sessions_opened_before_a_bad_input_are_reported_closed() -> None:
    ok = ScriptedMember("ok", drafts=[("x", True)])
    picky = ScriptedMember("picky", drafts=[("x", True)], fail_on={"open"}, errors={"open": InputError("no")})
    recorder = Recorder()
    with pytest.raises(InputError):
        SpecEM([ok, picky], SpecEMConfig(max_new_tokens=8), observers=[recorder]).generate("q")
    assert recorder.opened == recorder.closed == Counter({"ok": 1})


def test_all_members_failing_still_closes_every_session() -> None:
    a = ScriptedMember("a", drafts=[("x", True)], fail_on={"draft"})
    recorder = Recorder()
    with pytest.raises(AllMembersFailedError):
        SpecEM([a], SpecEMConfig(max_new_tokens=8, member_retries=0), observers=[recorder]).generate("q")
    assert recorder.opened == recorder.closed == Counter({"a": 1})


class Broken(MemberObserver):
    def session_opened(self, member: str) -> None:
        raise RuntimeError("observer bug")

    def session_closed(self, member: str) -> None:
        raise RuntimeError("observer bug")

    def call_finished(self, call: MemberCall) -> None:
        raise RuntimeError("observer bug")


def test_an_observer_that_raises_is_logged_and_the_request_completes(caplog: pytest.LogCaptureFixture) -> None:
    engine, _, _ = _pair()
    plain = _pair()[0].generate("q")
    recorder = Recorder()
    engine.add_observer(Broken())
    engine.add_observer(recorder)  # the ones after it still hear everything
    with caplog.at_level(logging.WARNING, logger="specem"):
        result = engine.generate("q")
    assert result.text == plain.text
    assert recorder.opened == recorder.closed == Counter({"a": 1, "b": 1})
    assert "observer bug" in caplog.text


def test_add_observer_returns_its_remover() -> None:
    engine, _, _ = _pair()
    recorder = Recorder()
    remove = engine.add_observer(recorder)
    engine.generate("q")
    seen = len(recorder.calls)
    remove()
    remove()  # idempotent
    engine.generate("q")
    assert len(recorder.calls) == seen


def test_an_object_that_is_no_observer_is_refused() -> None:
    with pytest.raises(TypeError):
        Observers([object()])  # type: ignore[list-item]


def test_without_observers_no_call_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object) -> None:
        raise AssertionError("wrapped a call with no observer registered")

    monkeypatch.setattr(MemberCalls, "observed", never)
    monkeypatch.setattr(MemberCalls, "opened", never)
    engine, _, _ = _pair()
    assert engine.generate("q").text


def test_async_requests_are_observed_and_their_workers_counted() -> None:
    engine, _, _ = _pair()
    recorder = Recorder()
    engine.add_observer(recorder)
    workers_during_calls: list[int] = []

    class WorkerCount(MemberObserver):  # told from the request's worker thread, while it runs
        def call_finished(self, call: MemberCall) -> None:
            workers_during_calls.append(engine.active_workers)

    engine.add_observer(WorkerCount())
    assert engine.active_workers == 0

    async def run() -> int:
        return len([event async for event in engine.astream("q")])

    assert asyncio.run(run()) >= 1
    # the worker counts while it runs (a consumer reading the count between events may find the
    # worker already done: scripted members answer at once)
    assert workers_during_calls
    assert set(workers_during_calls) == {1}
    assert engine.wait_idle(10)
    assert engine.active_workers == 0
    assert recorder.opened == recorder.closed == Counter({"a": 1, "b": 1})
