"""Cross-request batching for local transformers members.

Concurrent requests (``specem serve``, ``ChatSpecEM.batch``, threads sharing one engine) each
hold their own member sessions. Without coordination their forward passes run side by side and
compete for the same cores or GPU. A :class:`DeviceQueue` (one per device) instead runs one
forward pass at a time and merges the one-token decode steps that several sessions of the same
model are waiting on into one padded pass: a small model's decode step reads all its weights
for one row as for eight, so on a CPU (and more so on a GPU) the rows come almost for free
(measured by ``benchmarks/serve_load.py``: docs/reports/performance.md, "Serving under load").

The same goes for the sessions' verification blocks and for the prompt prefills of requests
arriving together. Batching is *continuous*: a step joins whichever pass starts next. The session
that starts a decode pass waits a few milliseconds (``gather_s``) for steps of sessions that are
in a drafting loop of the same model, so that requests drafting at once fall into step; the
remaining passes (rollbacks, multi-token feeds) run alone, in arrival order.

The pass itself (padding, masks, handing each session its new KV row) belongs to the backend;
this module only schedules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_GATHER_S = 0.005
"""How long the session starting a pass waits for the steps of other drafting sessions (a
session needs well under a millisecond between two steps to pick its token)."""


@dataclass(eq=False)
class Step(Generic[T]):
    """One session's one-token decode step, waiting for a pass."""

    group: Any
    """Steps with equal groups (one model) may share a pass."""
    payload: T
    """What the backend's batched pass needs (the session and its token)."""
    run: Callable[[Sequence[Step[T]]], Sequence[Any]]
    """Computes one pass for steps of this group; one result per step."""
    max_rows: int = 16
    """At most this many steps share a pass with this one."""
    kind: str = "decode"
    """``"decode"`` (one-token steps), ``"score"`` (verification blocks) or ``"prefill"`` (new
    sessions' prompts), for the statistics."""
    done: bool = False
    result: Any = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    """What the queue did (for tests, benchmarks and ``/health``-style reporting)."""

    device: str = ""
    passes: int = 0
    """Forward passes that served decode steps."""
    steps: int = 0
    """Decode steps served."""
    largest: int = 0
    """The most steps one pass served."""
    score_passes: int = 0
    """Forward passes that served verification blocks."""
    score_blocks: int = 0
    """Verification blocks served (one per session and round)."""
    prefill_passes: int = 0
    """Forward passes that served prompt prefills."""
    prefills: int = 0
    """Prompt prefills served."""
    exclusive: int = 0
    """Other forward passes (rollbacks, re-reads after a merged boundary, multi-token feeds)."""
    decode_s: float = 0.0
    """Seconds the device spent in passes serving decode steps."""
    score_s: float = 0.0
    """Seconds the device spent in verification passes."""
    prefill_s: float = 0.0
    """Seconds the device spent in prefill passes."""
    exclusive_s: float = 0.0
    """Seconds the device spent in the other passes."""

    @property
    def rows_per_pass(self) -> float:
        """Mean decode steps per pass (1.0: nothing was merged)."""
        return self.steps / self.passes if self.passes else 0.0

    def record(self, kind: str, served: int, seconds: float) -> None:
        """Count one merged pass of ``kind`` that served ``served`` steps in ``seconds``."""
        passes, count, time_field = _STAT_FIELDS[kind]
        setattr(self, passes, getattr(self, passes) + 1)
        setattr(self, count, getattr(self, count) + served)
        setattr(self, time_field, getattr(self, time_field) + seconds)
        if kind == "decode":
            self.largest = max(self.largest, served)


_STAT_FIELDS = {
    "decode": ("passes", "steps", "decode_s"),
    "score": ("score_passes", "score_blocks", "score_s"),
    "prefill": ("prefill_passes", "prefills", "prefill_s"),
}
"""Per kind of step: the counters :meth:`BatchStats.record` adds to."""


class DeviceQueue:
    """One forward pass at a time on a device; concurrent decode steps of one model share a pass."""

    def __init__(self, device: str = "", gather_s: float = _GATHER_S) -> None:
        self.gather_s = gather_s
        self.stats = BatchStats(device=device)
        self._cond = threading.Condition()
        self._busy = False
        self._steps: list[Step[Any]] = []
        self._drafting: dict[Any, int] = {}

    @contextmanager
    def drafting(self, group: Any) -> Iterator[None]:
        """Mark a session of ``group`` as being in a drafting loop (its steps are worth waiting for)."""
        with self._cond:
            self._drafting[group] = self._drafting.get(group, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._drafting[group] -= 1
                self._cond.notify_all()  # a pass being gathered may stop waiting for this session

    def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a forward pass) when the device is free."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            self._busy = True
            self.stats.exclusive += 1
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.stats.exclusive_s += time.perf_counter() - start
            self._release()

    def step(self, step: Step[Any]) -> Any:
        """Wait for ``step`` to be served and return its result.

        Whichever waiting thread finds the device free serves the group of the oldest step, with
        that step's ``run``: a thread may compute a pass for another model's sessions.
        """
        with self._cond:
            self._steps.append(step)
            self._cond.notify_all()
            while not step.done:
                if self._busy:
                    self._cond.wait()
                    continue
                self._busy = True
                batch = self._gather()
                self._cond.release()
                start = time.perf_counter()
                try:
                    self._serve(batch)
                finally:
                    self._cond.acquire()
                    self.stats.record(batch[0].kind, len(batch), time.perf_counter() - start)
                    self._busy = False
                    self._cond.notify_all()
        if step.error is not None:
            raise step.error
        return step.result

    def _gather(self) -> list[Step[Any]]:
        """(Lock held, device claimed.) Take the oldest step's group, after waiting briefly for the
        steps of that group's other drafting sessions."""
        group, max_rows = self._steps[0].group, self._steps[0].max_rows
        deadline = time.monotonic() + self.gather_s
        while True:
            mine = [s for s in self._steps if s.group == group]
            wanted = min(self._drafting.get(group, 0), max_rows)
            remaining = deadline - time.monotonic()
            if len(mine) >= wanted or remaining <= 0:
                break
            self._cond.wait(remaining)
        batch = mine[:max_rows]
        taken = set(map(id, batch))
        self._steps = [s for s in self._steps if id(s) not in taken]
        return batch

    @staticmethod
    def _serve(batch: Sequence[Step[Any]]) -> None:
        try:
            results = batch[0].run(batch)
            for s, r in zip(batch, results, strict=True):
                s.result = r
        except BaseException as exc:  # every waiting session sees the failure (the engine retries)
            for s in batch:
                s.error = exc
        finally:
            for s in batch:
                s.done = True

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


_QUEUES: dict[str, DeviceQueue] = {}
_QUEUES_LOCK = threading.Lock()


def device_queue(device: str) -> DeviceQueue:
    """The queue of ``device`` (``"cpu"``, ``"cuda:0"``…), shared by every member placed on it."""
    with _QUEUES_LOCK:
        if device not in _QUEUES:
            _QUEUES[device] = DeviceQueue(device)
        return _QUEUES[device]
