"""What the server shows of itself now: the load, the open member sessions (counted by an
observer on the engine), the engine's worker threads (asked of the engine), readiness, the
members' circuit breakers and batching queues. ``/health`` and the gauges of ``/metrics`` read it."""

from __future__ import annotations

import time
from typing import Any

from specem_core.backends.base import BatchingMember, BreakerMember, VerificationMember
from specem_core.backends.llama_cpp import SharedStats
from specem_core.engine import SpecEM
from specem_integrations.server._admission import Admission, Stats
from specem_integrations.server._metrics import LiveState
from specem_integrations.server._readiness import Readiness
from specem_integrations.server._sessions import SessionCounter


class LiveView:
    """The live state of one app.

    Args:
        engine: the served engine.
        admission: the request slots and queue.
        readiness: probes and draining.
        stats: the ``/health`` counters.
        sessions: the open-session counter registered on ``engine`` (``None``: not counted).
    """

    def __init__(
        self,
        engine: SpecEM,
        admission: Admission,
        readiness: Readiness,
        stats: Stats,
        sessions: SessionCounter | None,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.readiness = readiness
        self.stats = stats
        self.sessions = sessions
        self.started = time.time()

    def sessions_open(self) -> int | None:
        """Member sessions open now (``None`` when not counted)."""
        return self.sessions.open if self.sessions is not None else None

    def engine_workers(self) -> int:
        """Engine worker threads alive (a cancelled request's worker ends after its current round)."""
        return self.engine.active_workers

    def health(self, model: str, members: list[str]) -> dict[str, Any]:
        """The body of ``GET /health``."""
        return {
            "status": "ok",
            "ready": self.readiness.ready,
            "draining": self.readiness.draining,
            "model": model,
            "members": members,
            "max_concurrency": self.admission.max_concurrency,
            "queue": self.admission.queue,
            "requests_in_flight": self.admission.running,
            "requests_queued": self.admission.waiting,
            "sessions_open": self.sessions_open(),
            "sessions_opened_total": self.sessions.opened_total if self.sessions is not None else None,
            "engine_workers": self.engine_workers(),
            "decode_batching": self.decode_batching(),
            "requests": self.stats.to_dict(),
            "uptime_s": round(time.time() - self.started, 3),
        }

    def state(self) -> LiveState:
        """What the metrics' gauges show now."""
        weights = self.engine.member_weights
        return LiveState(
            running=self.admission.running,
            queued=self.admission.waiting,
            max_concurrency=self.admission.max_concurrency,
            queue=self.admission.queue,
            sessions_open=self.sessions_open(),
            engine_workers=self.engine_workers(),
            ready=self.readiness.ready,
            draining=self.readiness.draining,
            breakers=[(m.name, m.breaker) for m in self.engine.members if isinstance(m, BreakerMember)],
            weights=weights.current() if weights is not None else {},
            verification=[
                (m.name, m.verification)
                for m in self.engine.members
                if isinstance(m, VerificationMember) and m.verification is not None
            ],
        )

    def decode_batching(self) -> dict[str, dict[str, Any]]:
        """Per device queue (transformers members batching across requests): passes that served
        decode steps, the steps, how many shared a pass on average and at most; verification
        passes and the blocks they served; prefill passes and the prompts they served; other
        passes (rollbacks, multi-token feeds); device seconds in each kind. Per llama.cpp model
        with continuous batching (``llama.cpp:NAME``): its ``llama_decode`` calls, those that
        served several sessions, the pieces of work served (``jobs``: a draft step, a verification
        block, a prefill chunk), sessions per call on average and at most, tokens and seconds; with
        ``history_invariant`` too, the calls that carried a padding token, the compactions of the
        cache and the order breaks (cells freed during a call: answers then running may differ
        from alone)."""
        out: dict[str, dict[str, Any]] = {}
        for member in self.engine.members:
            shared = getattr(member, "shared_stats", None)
            model = getattr(getattr(member, "model", None), "name", member.name)
            if isinstance(shared, SharedStats) and f"llama.cpp:{model}" not in out:
                out[f"llama.cpp:{model}"] = {
                    "calls": shared.calls,
                    "shared_calls": shared.shared_calls,
                    "jobs": shared.jobs,
                    "sessions_per_call": round(shared.sessions_per_call, 3),
                    "largest": shared.largest,
                    "tokens": shared.tokens,
                    "seconds": round(shared.seconds, 3),
                    "padded_calls": shared.padded_calls,
                    "compactions": shared.compactions,
                    "order_breaks": shared.order_breaks,
                }
        for member in self.engine.members:
            stats = member.batch_stats if isinstance(member, BatchingMember) else None
            if stats is not None and f"torch:{stats.device}" not in out:
                out[f"torch:{stats.device}"] = {
                    "passes": stats.passes,
                    "decode_steps": stats.steps,
                    "rows_per_pass": round(stats.rows_per_pass, 3),
                    "largest": stats.largest,
                    "score_passes": stats.score_passes,
                    "score_blocks": stats.score_blocks,
                    "prefill_passes": stats.prefill_passes,
                    "prefills": stats.prefills,
                    "other_passes": stats.exclusive,
                    "decode_seconds": round(stats.decode_s, 3),
                    "score_seconds": round(stats.score_s, 3),
                    "prefill_seconds": round(stats.prefill_s, 3),
                    "other_seconds": round(stats.exclusive_s, 3),
                }
        return out
