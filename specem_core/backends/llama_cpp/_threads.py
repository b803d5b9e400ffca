"""Threads per decode that follow the CPU cores other processes leave free.

Why: llama.cpp's CPU threads wait for each other at a barrier after every operation of a graph
(hundreds per token), and they wait by spinning: in the OpenMP build llama-cpp-python makes by
default (``#pragma omp barrier``: libgomp spins ``GOMP_SPINCOUNT`` rounds before it sleeps) and in
builds without OpenMP (``ggml_barrier`` only spins; a ggml threadpool's ``poll=0`` stops the
spinning between graphs, not at barriers, and an OpenMP build has no threadpool threads at all).
When another process takes a core, one of a graph's threads is descheduled and the others spin
through their time slices waiting for it: with every core busy, a 2-thread decode on 2 cores ran
20-77x slower than alone (issue #63). One thread never waits at a barrier, and threads that each
have a core of their own never wait long.

How: before each decode, the thread count is the number of cores that other processes left
idle, measured from ``/proc/stat`` (busy ticks of the CPUs this process may use) minus this
process's own CPU time (``os.times``), over the last :data:`SAMPLE_SECONDS` or more: this
process's own threads, spinning or not, never count as load. The free cores are shared between
this process's decodes running at the same time (concurrent requests), and the count stays
between 1 and the model's limit (:func:`threads_for`). Logits do not depend on the thread count
(bit for bit on the packaged models: ``tests/test_llama_cpp_threads.py``), so the choice changes
speed only.

Where ``/proc/stat`` cannot be read (not Linux), every core counts as free: the limit is used.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

SAMPLE_SECONDS = 0.25
"""The shortest window the load is measured over (25 ticks of each CPU at 100 Hz)."""
MIN_TICKS_PER_CPU = 5
"""A window with fewer ticks per CPU than this is too short to tell: the previous estimate stands."""

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""user, nice, system, irq, softirq, steal: time a CPU ran something (steal: another VM did)."""
_IDLE_FIELDS = (3, 4)
"""idle, iowait (guest and guest_nice are already inside user and nice)."""


@dataclass(frozen=True)
class CpuReading:
    """One reading of the CPUs this process may use (cumulative since boot)."""

    busy_ticks: int
    """Ticks the CPUs spent running anything, this process included."""
    total_ticks: int
    """Ticks of those CPUs, busy or idle."""
    own_seconds: float
    """CPU seconds this process used, all its threads together (user + system)."""


def parse_proc_stat(text: str, cpus: Collection[int] | None = None) -> tuple[int, int]:
    """``(busy, total)`` ticks of ``/proc/stat``'s per-CPU lines for ``cpus`` (``None``: every
    CPU, from the aggregate ``cpu`` line).

    Raises:
        ValueError: no line for those CPUs.
    """
    busy = total = 0
    found = False
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        label, *fields = line.split()
        if cpus is None:
            if label != "cpu":
                continue
        elif label == "cpu" or int(label[3:]) not in cpus:
            continue
        values = [int(v) for v in fields]
        values += [0] * (8 - len(values))  # old kernels have fewer columns
        busy += sum(values[i] for i in _BUSY_FIELDS)
        total += sum(values[i] for i in _BUSY_FIELDS + _IDLE_FIELDS)
        found = True
    if not found:
        raise ValueError(f"/proc/stat has no line for CPUs {sorted(cpus) if cpus is not None else 'all'}")
    return busy, total


def others_busy_cores(before: CpuReading, after: CpuReading, n_cpus: int, ticks_per_second: float) -> float | None:
    """How many of ``n_cpus`` cores other processes kept busy between two readings, on average
    (``None`` when the window holds fewer than :data:`MIN_TICKS_PER_CPU` ticks per CPU).

    The CPUs' busy share times ``n_cpus`` is every process's load; this process's own CPU time
    over the window's length is its part of it."""
    total = after.total_ticks - before.total_ticks
    if n_cpus < 1 or total < MIN_TICKS_PER_CPU * n_cpus:
        return None
    busy_cores = (after.busy_ticks - before.busy_ticks) / total * n_cpus
    window_seconds = total / n_cpus / ticks_per_second
    own_cores = (after.own_seconds - before.own_seconds) / window_seconds
    return min(float(n_cpus), max(0.0, busy_cores - own_cores))


def threads_for(free_cores: float, n_cpus: int, limit: int, running: int = 1) -> int:
    """Threads for one decode: the whole cores among ``free_cores`` (of ``n_cpus``), shared between
    the ``running`` decodes of this process that run at the same time, at least 1 and at most ``limit``.

    A core counts when others leave at least ``1 - 1.5 / (n_cpus + 1)`` of it (half a core of 2,
    0.7 of 4, 0.83 of 8). Why that margin: while this process runs ``t`` threads beside other
    processes that want ``h`` cores, the scheduler shares the cores evenly, so what others leave
    looks like ``n t / (h + t)`` cores, not ``n - h``; with one thread too many
    (``t = n - h + 1``) that is less than ``t - 1.5 / (n + 1)`` for every ``h < n``, so the count
    comes back down to ``n - h``, and the margin still forgives light background load."""
    margin = 1.5 / (max(1, n_cpus) + 1)
    whole = int(free_cores + margin)
    return max(1, min(limit, whole // max(1, running)))


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return list(range(os.cpu_count() or 1))


def read_cpu(cpus: Collection[int] | None = None, path: str = "/proc/stat") -> CpuReading:
    """A reading of ``cpus`` now (``OSError``/``ValueError`` where ``/proc/stat`` is missing or odd)."""
    with open(path, encoding="ascii") as f:
        busy, total = parse_proc_stat(f.read(), cpus)
    times = os.times()
    return CpuReading(busy, total, times.user + times.system)


class FreeCores:
    """The cores other processes leave free, re-measured at most every ``interval`` seconds, and
    the decodes of this process running now (thread-safe; one per process: :func:`free_cores`).

    Args:
        read: a reading of the CPUs now (injected by tests).
        n_cpus: how many CPUs ``read`` covers.
        ticks_per_second: the unit of ``/proc/stat`` (``SC_CLK_TCK``).
        clock: monotonic seconds.
        interval: the shortest window between two measurements.
    """

    def __init__(
        self,
        read: Callable[[], CpuReading],
        n_cpus: int,
        ticks_per_second: float,
        clock: Callable[[], float] = time.monotonic,
        interval: float = SAMPLE_SECONDS,
    ) -> None:
        self._read = read
        self.n_cpus = n_cpus
        self._ticks = ticks_per_second
        self._clock = clock
        self._interval = interval
        self._lock = threading.Lock()
        self._last: CpuReading | None = None
        self._last_time = 0.0
        self._free = float(n_cpus)
        self._running = 0
        self.available = True
        """False once ``/proc/stat`` could not be read: every core counts as free from then on."""

    def estimate(self) -> float:
        """Cores free of other processes' load (all of them until a first window is measured)."""
        with self._lock:
            self._update()
            return self._free

    def _update(self) -> None:
        if not self.available:
            return
        now = self._clock()
        if self._last is not None and now - self._last_time < self._interval:
            return
        try:
            reading = self._read()
        except (OSError, ValueError):
            self.available = False
            self._free = float(self.n_cpus)
            return
        if self._last is not None:
            others = others_busy_cores(self._last, reading, self.n_cpus, self._ticks)
            if others is None:
                return  # too few ticks yet: keep the older reading as the window's start
            self._free = self.n_cpus - others
        self._last, self._last_time = reading, now

    @contextlib.contextmanager
    def decoding(self, limit: int) -> Iterator[int]:
        """Count one decode of this process as running while the block runs; yields its threads
        (:func:`threads_for` the free cores, shared with the decodes already running)."""
        with self._lock:
            self._update()
            self._running += 1
            threads = threads_for(self._free, self.n_cpus, limit, self._running)
        try:
            yield threads
        finally:
            with self._lock:
                self._running -= 1


_MONITOR: FreeCores | None = None
_MONITOR_LOCK = threading.Lock()


def free_cores() -> FreeCores:
    """This process's :class:`FreeCores` over the CPUs it may use (made on first use)."""
    global _MONITOR
    with _MONITOR_LOCK:
        if _MONITOR is None:
            cpus = frozenset(allowed_cpus())
            try:
                ticks = float(os.sysconf("SC_CLK_TCK"))
            except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
                ticks = 100.0
            _MONITOR = FreeCores(lambda: read_cpu(cpus), len(cpus), ticks)
        return _MONITOR
