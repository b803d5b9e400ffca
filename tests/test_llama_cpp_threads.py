"""Threads per decode that follow the free cores (issue #63): the estimator's logic on synthetic
``/proc/stat`` readings, and the llama.cpp backend applying the count it chooses (read back from
the context with ``llama_n_threads``). No timings: ``benchmarks/contention.py`` measures speed."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaged_gguf import packaged_gguf_or_skip

from specem_core import ConfigError
from specem_core.backends.llama_cpp import _threads
from specem_core.backends.llama_cpp._threads import (
    CpuReading,
    FreeCores,
    others_busy_cores,
    parse_proc_stat,
    threads_for,
)

TICKS = 100.0  # USER_HZ

PROC_STAT = """cpu  4705 356 584 3699 23 23 0 0 0 0
cpu0 1393 280 234 1883 10 8 0 0 0 0
cpu1 1512 76 350 1816 13 15 0 0 0 0
cpu2 1800 0 0 0 0 0 0 0 0 0
intr 114930548 113199788 3 0 5 263 0 4 [... lots more numbers ...]
ctxt 1990473
procs_running 3
"""


class SyntheticCpu:
    """``/proc/stat`` and ``os.times`` as they would read while others and this process keep some
    cores busy: each reading is ``seconds`` later than the one before."""

    def __init__(self, n_cpus: int, seconds: float = 0.5) -> None:
        self.n_cpus = n_cpus
        self.seconds = seconds
        self.others = 0.0
        """Cores other processes keep busy now."""
        self.ours = 0.0
        """Cores this process keeps busy now (its threads working or spinning)."""
        self._busy = self._total = 0
        self._own = 0.0

    def read(self) -> CpuReading:
        ticks = self.seconds * TICKS
        self._total += round(ticks * self.n_cpus)
        self._busy += round(ticks * min(self.n_cpus, self.others + self.ours))
        self._own += self.ours * self.seconds
        return CpuReading(self._busy, self._total, self._own)


def _window(n_cpus: int, others: float, ours: float) -> float:
    cpu = SyntheticCpu(n_cpus)
    before = cpu.read()
    cpu.others, cpu.ours = others, ours
    measured = others_busy_cores(before, cpu.read(), n_cpus, TICKS)
    assert measured is not None
    return measured


# -- /proc/stat ---------------------------------------------------------------------------------
def test_proc_stat_lines_of_the_allowed_cpus_are_summed() -> None:
    # busy: user nice system irq softirq steal; total adds idle and iowait (guest is inside user)
    assert parse_proc_stat(PROC_STAT, {0}) == (1393 + 280 + 234 + 8, 1393 + 280 + 234 + 1883 + 10 + 8)
    busy01, total01 = parse_proc_stat(PROC_STAT, {0, 1})
    assert (busy01, total01) == (1915 + 1953, 3808 + 3782)
    assert parse_proc_stat(PROC_STAT, None) == (4705 + 356 + 584 + 23, 4705 + 356 + 584 + 3699 + 23 + 23)
    assert parse_proc_stat("cpu0 10 0 5 85\n", {0}) == (15, 100)  # an old kernel's four columns
    with pytest.raises(ValueError, match="no line for CPUs"):
        parse_proc_stat(PROC_STAT, {7})


def test_steal_counts_as_busy() -> None:
    assert parse_proc_stat("cpu0 0 0 0 50 0 0 0 50 0 0\n", {0}) == (50, 100)


# -- the load of other processes ----------------------------------------------------------------
def test_this_processs_own_threads_are_never_counted_as_load() -> None:
    # an idle machine while our two threads compute (or spin at a barrier): nothing is taken
    assert _window(2, others=0.0, ours=2.0) == pytest.approx(0.0)
    assert threads_for(2 - _window(2, 0.0, 2.0), 2, 2) == 2  # no loss when the machine is idle
    assert _window(8, others=0.0, ours=8.0) == pytest.approx(0.0)
    assert threads_for(8 - _window(8, 0.0, 8.0), 8, 8) == 8


def test_other_processes_load_is_what_the_cpus_did_beyond_ours() -> None:
    assert _window(2, others=2.0, ours=0.0) == pytest.approx(2.0)
    # two spinning hogs beside our two threads: the scheduler gives each thread half a core
    assert _window(2, others=1.0, ours=1.0) == pytest.approx(1.0)
    assert _window(4, others=1.5, ours=2.5) == pytest.approx(1.5)


def test_a_window_too_short_to_tell_gives_none_and_noise_never_goes_negative() -> None:
    before = CpuReading(0, 0, 0.0)
    assert others_busy_cores(before, CpuReading(2, 4, 0.0), 2, TICKS) is None  # 2 ticks a CPU
    # our own CPU time (precise) a little above the sampled ticks: no load, not a negative one
    assert others_busy_cores(before, CpuReading(100, 100, 1.1), 2, TICKS) == 0.0
    assert others_busy_cores(before, CpuReading(100, 100, 0.0), 2, TICKS) == 2.0


# -- threads from free cores --------------------------------------------------------------------
def test_the_count_is_the_free_cores_between_one_and_the_limit() -> None:
    assert threads_for(2.0, 2, 2) == 2
    assert threads_for(1.0, 2, 2) == 1
    assert threads_for(0.0, 2, 2) == 1  # every core busy: one thread never waits at a barrier
    assert threads_for(8.0, 8, 4) == 4  # the model's limit
    assert threads_for(1.7, 2, 2) == 2  # light background load (0.3 of a core) keeps both
    assert threads_for(3.8, 4, 4) == 4


def test_the_count_settles_where_no_thread_waits_for_a_taken_core() -> None:
    """While ``t`` threads run beside others who want ``h`` cores, others seem to take their fair
    share ``n h / (h + t)``: with too many threads the count comes down, and at ``n - h`` it stays."""
    for n in range(1, 17):
        for h in range(n):
            assert threads_for(n - h, n, n) == n - h, (n, h)  # each thread has its core: kept
            for t in range(n - h + 1, n + 1):
                free = n * t / (h + t)
                assert threads_for(free, n, n) < t, (n, h, t)  # one too many: fewer next time


def test_decodes_running_at_once_share_the_free_cores() -> None:
    assert threads_for(2.0, 2, 2, running=2) == 1
    assert threads_for(8.0, 8, 8, running=3) == 2
    assert threads_for(1.0, 2, 2, running=4) == 1


# -- the monitor --------------------------------------------------------------------------------
def _monitor(cpu: SyntheticCpu, interval: float = 0.25) -> tuple[FreeCores, list[float]]:
    now = [0.0]
    return FreeCores(cpu.read, cpu.n_cpus, TICKS, clock=lambda: now[0], interval=interval), now


def test_the_monitor_remeasures_at_most_once_per_interval() -> None:
    cpu = SyntheticCpu(2)
    monitor, now = _monitor(cpu)
    assert monitor.estimate() == 2.0  # no window yet: every core counts as free
    cpu.others = 2.0
    assert monitor.estimate() == 2.0  # the same instant: not measured again
    now[0] = 0.3
    assert monitor.estimate() == pytest.approx(0.0)
    cpu.others = 1.0
    now[0] = 0.4  # within the interval: the last estimate stands
    assert monitor.estimate() == pytest.approx(0.0)
    now[0] = 0.6
    assert monitor.estimate() == pytest.approx(1.0)
    cpu.others = 0.0
    now[0] = 0.9
    assert monitor.estimate() == pytest.approx(2.0)  # the load went away: all cores again


def test_a_short_window_keeps_its_start_until_it_is_long_enough() -> None:
    cpu = SyntheticCpu(2, seconds=0.02)  # 2 ticks a CPU per reading
    monitor, now = _monitor(cpu, interval=0.0)
    monitor.estimate()
    cpu.others = 2.0
    now[0] = 0.1
    assert monitor.estimate() == 2.0  # 2 ticks: too few to tell
    now[0] = 0.2
    assert monitor.estimate() == 2.0  # 4 ticks
    now[0] = 0.3
    assert monitor.estimate() == pytest.approx(0.0)  # 6 ticks since the first reading: measured


def test_without_proc_stat_every_core_counts_as_free() -> None:
    def unreadable() -> CpuReading:
        raise OSError("no /proc here")

    monitor = FreeCores(unreadable, 4, TICKS)
    assert monitor.estimate() == 4.0
    assert not monitor.available
    with monitor.decoding(4) as threads:
        assert threads == 4


def test_decodes_running_at_once_are_counted_while_they_run() -> None:
    cpu = SyntheticCpu(2)
    monitor, _ = _monitor(cpu)
    with monitor.decoding(2) as first:
        assert first == 2
        with monitor.decoding(2) as second:
            assert second == 1  # two decodes at once on two free cores: one thread each
    with monitor.decoding(2) as alone:
        assert alone == 2  # both finished: counted down again


def test_n_threads_setting() -> None:
    from specem_core.backends.llama_cpp import default_threads
    from specem_core.backends.llama_cpp.model import thread_setting

    assert thread_setting("auto") == (True, default_threads())
    assert thread_setting(None) == (True, default_threads())
    assert thread_setting(3) == (False, 3)
    for bad in (0, -2, "fast", True, 1.5, "2"):
        with pytest.raises(ConfigError, match="n_threads must be 'auto' or a positive int"):
            thread_setting(bad)


# -- the backend applies the count --------------------------------------------------------------
llama_cpp_missing = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (scripts/build_llama_cpp.sh)",
)


def _gguf(name: str) -> Path:
    return packaged_gguf_or_skip(name)


@pytest.fixture
def synthetic_load(monkeypatch: pytest.MonkeyPatch) -> SyntheticCpu:
    """The process's free-core monitor replaced by one over a synthetic 2-CPU machine, measured
    afresh at every decode."""
    cpu = SyntheticCpu(2)
    monkeypatch.setattr(_threads, "_MONITOR", FreeCores(cpu.read, 2, TICKS, interval=0.0))
    return cpu


def _decode_threads(model: object) -> tuple[int, int]:
    """Decode one token in a fresh context; the context's thread counts afterwards."""
    from specem_core.backends.llama_cpp._binding import Work

    ctx = model.acquire_context()  # type: ignore[attr-defined]
    try:
        ctx.decode(Work([1], [0], [0], [-1]))
        lib = model.lib  # type: ignore[attr-defined]
        return int(lib.llama_n_threads(ctx._ctx)), int(lib.llama_n_threads_batch(ctx._ctx))
    finally:
        model.release_context(ctx)  # type: ignore[attr-defined]


@llama_cpp_missing
def test_the_backend_decodes_with_the_count_the_free_cores_allow(synthetic_load: SyntheticCpu) -> None:
    from specem_core.backends.llama_cpp import LlamaCppModel, default_threads

    if default_threads() < 2:
        pytest.skip("one CPU: the count cannot move")
    auto = LlamaCppModel(_gguf("smollm2"), n_ctx=512)
    pinned = LlamaCppModel(_gguf("smollm2"), n_ctx=512, n_threads=2)
    try:
        assert auto.auto_threads
        assert not pinned.auto_threads
        assert "'auto'" in repr(auto)
        synthetic_load.others = 2.0  # every core busy
        assert _decode_threads(auto) == (1, 1)
        assert _decode_threads(pinned) == (2, 2)  # a pinned count stays
        synthetic_load.others = 0.0
        synthetic_load.ours = 2.0  # only our own threads busy: both cores again
        assert _decode_threads(auto) == (2, 2)
        synthetic_load.others, synthetic_load.ours = 1.0, 1.0
        assert _decode_threads(auto) == (1, 1)
        assert auto.decodes_by_threads == {1: 2, 2: 1}
        assert pinned.decodes_by_threads == {2: 1}
    finally:
        auto.close()
        pinned.close()


@llama_cpp_missing
def test_member_options_reach_the_model() -> None:
    from specem_core.registry import load_member

    member = load_member("smollm2", backend="llamacpp", n_threads=1, n_ctx=512)
    model = member.model  # type: ignore[attr-defined]
    assert not model.auto_threads
    assert model.n_threads == 1
    with pytest.raises(ConfigError, match="n_threads"):
        load_member("smollm2", backend="llamacpp", n_threads="many", n_ctx=512)


@llama_cpp_missing
@pytest.mark.parametrize("name", ["smollm2", "qwen2.5-coder"])
def test_logits_do_not_depend_on_the_thread_count(name: str) -> None:
    """Why following the free cores changes speed only: every logit is the same, bit for bit, on
    one thread or two (a prompt past 64 positions, then a multi-sequence verification batch)."""
    import numpy as np

    from specem_core.backends.llama_cpp import LlamaCppModel
    from specem_core.backends.llama_cpp._binding import Work

    model = LlamaCppModel(_gguf(name), n_ctx=1024, n_threads=1)
    try:
        prompt = model.tokenize(
            "def fibonacci(n):\n" + "    # the n-th number of the sequence\n" * 7, add_special=True, parse_special=False
        )
        assert len(prompt) > 64
        n = len(prompt)
        candidates = [prompt[1:9], prompt[9:17]]
        rows: dict[int, list[np.ndarray]] = {}
        for threads in (1, 2):
            ctx = model.acquire_context()
            try:
                model.n_threads = threads  # pinned: the context's decodes switch to it
                out = ctx.decode(Work(prompt, list(range(n)), [0] * n, [-1] * n)).rows
                got = [out[i] for i in range(n)]
                tokens, positions, seqs = [], [], []
                for cand in candidates:
                    seq = ctx.take_scratch()
                    ctx.share(0, seq, 0, n)
                    tokens += cand
                    positions += list(range(n, n + len(cand)))
                    seqs += [seq] * len(cand)
                verified = ctx.decode(Work(tokens, positions, seqs, [-1] * len(tokens))).rows
                got += [verified[i] for i in range(len(tokens))]
                assert int(ctx._lib.llama_n_threads(ctx._ctx)) == threads
                rows[threads] = got
            finally:
                ctx.reset()
                model.release_context(ctx)
        assert all(np.array_equal(a, b) for a, b in zip(rows[1], rows[2], strict=True))
    finally:
        model.close()
