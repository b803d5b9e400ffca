"""Member weights learned across requests (opt-in), with priors, saved as a small JSON file.

Three things are called weights in SpecEM (see the glossary, ``docs/reference/glossary.md``):
*verifier weights* are one request's Hedge weights, one per verifier, that weigh the verifiers'
rows in each round's vote; *member weights* (this module) are learned across requests and give
each request its starting verifier weights; *model weights* are a member's model files (a GGUF, a
Hugging Face checkpoint), which this module never touches.

The paper's Hedge restarts from uniform verifier weights on every request, and with two members its
reward ``max(wins, 1)/(N−1)²`` is 1 for both whatever happens, so nothing is ever learned. A
:class:`MemberWeights` object carried by the engine changes that: every request starts its
verifier weights from the member weights learned so far (times the prior), and after the request
the verifiers' Hedge rewards are added to a running total. The member weights are an anytime
Hedge over requests:

    w_m ∝ prior_m · exp(η0 · R_m / sqrt(T_m))

with R_m the sum over requests of member m's mean reward minus the members' mean (so a request
where all members do equally well moves nothing) and T_m the number of requests that compared
member m with others. A member absent from a request (not among its members, failed, or gated)
is a sleeping expert: its member weight neither learns nor fades while it is away.

Example:
    >>> from specem_core.weights import MemberWeights
    >>> w = MemberWeights(prior={"big": 3.0, "small": 1.0})
    >>> [round(x, 2) for x in w.start(["big", "small"])]
    [0.75, 0.25]
    >>> w.observe({"big": [1.0, 1.0], "small": [0.5, 0.25]})
    >>> w.requests
    1
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specem_core.errors import ConfigError

log = logging.getLogger("specem.weights")

_FORMAT = "specem-member-weights/1"
_HISTORY_LIMIT = 10_000
"""Snapshots kept in ``history``: the state is saved after every request, so it must stay small."""


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _share(value: float) -> float:
    """A validated ``min_share``."""
    if not _finite(value) or not 0.0 <= value < 1.0:
        raise ConfigError(f"min_share must be a number in [0, 1), got {value!r}")
    return float(value)


class MemberWeights:
    """Member weights: shared by every request of an engine (each request's starting verifier
    weights), learned online, savable as JSON.

    Args:
        prior: relative trust per member name (any positive numbers; they are normalized over the
            verifiers of each request). Members without an entry get the mean of the given
            priors, or 1 when there are none. A prior can come from a small labelled
            calibration set (e.g. each member's accuracy alone) or from model size.
        learning_rate: η0 of the Hedge across requests; 0 keeps the prior fixed.
        max_log_ratio: bound on how far learning alone may move the log-weight of one member
            from the mean (keeps a member that loses a long run of requests able to come back).
        min_share: members whose member-weight share, among a request's verifiers, is below this sit
            the request out: they neither draft nor verify, and the result reports them as
            excluded at stage ``"gate"``. This keeps a weak member from costing the ensemble
            quality (its segments still win where other verifiers rate them highest) and time.
            A gated member learns nothing more, so it stays out until the others' member weights move,
            the state is reset, or ``min_share`` is lowered. 0 (the default) gates nobody; the
            best-weighted drafter is never gated.

    Thread-safe: concurrent requests read and update it under a lock.
    """

    def __init__(
        self,
        prior: Mapping[str, float] | None = None,
        *,
        learning_rate: float = 1.0,
        max_log_ratio: float = 4.0,
        min_share: float = 0.0,
    ) -> None:
        self.prior: dict[str, float] = {}
        """The prior as given, per member name (before normalization)."""
        for name, value in (prior or {}).items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"member weight priors are keyed by member name; got {name!r}")
            if not _finite(value) or value <= 0:
                raise ConfigError(f"the prior of member {name!r} must be a positive finite number, got {value!r}")
            self.prior[name] = float(value)
        for label, number in (("learning_rate", learning_rate), ("max_log_ratio", max_log_ratio)):
            if not _finite(number) or number < 0:
                raise ConfigError(f"{label} must be a finite number >= 0, got {number!r}")
        self.learning_rate = float(learning_rate)
        """η0 of the Hedge across requests (0: the prior stays fixed)."""
        self.max_log_ratio = float(max_log_ratio)
        """Bound on how far learning alone may move one member's log-weight from the mean."""
        self.min_share = _share(min_share)
        """Member-weight share below which a member sits a request out (0: nobody)."""
        self.cumulative: dict[str, float] = {}
        """Sum over requests of each member's centred mean Hedge reward (R_m)."""
        self.requests = 0
        """Requests that contributed (had at least one contested vote)."""
        self.counts: dict[str, int] = {}
        """Per member, the contributing requests it took part in (T_m)."""
        self.history: list[dict[str, float]] = []
        """The normalized member weights after each contributing request (the last 10,000; to see
        how fast they settle)."""
        self.path: Path | None = None
        """Where :meth:`observe` saves the state after each request (set by :meth:`open`)."""
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        prior: Mapping[str, float] | None = None,
        **options: float,
    ) -> MemberWeights:
        """The state kept in ``path``: loaded when the file exists, else a new one (with this prior
        and options) written there now; either way saved there after every request that teaches it.
        ``min_share`` given here also applies to a loaded state (a gate is a serving choice).

        Raises:
            ConfigError: the file exists but is not a member-weights state, or cannot be written.
        """
        if Path(path).exists():
            state = cls.load(path)
            if "min_share" in options and options["min_share"] != state.min_share:
                state.min_share = _share(options["min_share"])
                state.save(path)
        else:
            state = cls(prior, **options)
            try:  # create it now: a path that cannot be written fails before any model loads
                state.save(path)
            except OSError as exc:
                raise ConfigError(f"cannot write member-weights file {path}: {exc}") from exc
        state.path = Path(path)
        return state

    # -- use ---------------------------------------------------------------------------------
    def start(self, names: Sequence[str]) -> list[float]:
        """Normalized starting verifier weights of these verifiers for a new request (their
        member weights)."""
        with self._lock:
            return self._weights(names)

    def gated(self, names: Sequence[str]) -> dict[str, float]:
        """The members among ``names`` whose member-weight share is below ``min_share``, with their share."""
        if self.min_share <= 0.0 or len(names) < 2:
            return {}
        with self._lock:
            shares = self._weights(names)
        return {n: s for n, s in zip(names, shares, strict=True) if s < self.min_share}

    def current(self) -> dict[str, float]:
        """The member weight of every member seen so far (prior or learned), normalized over them."""
        with self._lock:
            names = sorted(set(self.prior) | set(self.cumulative))
            return dict(zip(names, self._weights(names), strict=True)) if names else {}

    def observe(self, rewards: Mapping[str, Sequence[float]]) -> None:
        """Learn from one request: ``rewards[name]`` are the Hedge rewards of that verifier in each
        contested round. Members are compared on their mean reward, centred on the members' mean.
        A state file that cannot be written is logged (warning) and the state kept in memory: the
        request's answer is already made and must not be lost to a full or read-only disk."""
        means = {name: sum(values) / len(values) for name, values in rewards.items() if values}
        if len(means) < 2:
            return  # nothing was compared
        centre = sum(means.values()) / len(means)
        with self._lock:
            for name, mean in means.items():
                self.cumulative[name] = self.cumulative.get(name, 0.0) + (mean - centre)
                self.counts[name] = self.counts.get(name, 0) + 1
            self.requests += 1
            names = sorted(set(self.prior) | set(self.cumulative))
            self.history.append({n: round(w, 6) for n, w in zip(names, self._weights(names), strict=True)})
            del self.history[:-_HISTORY_LIMIT]
        if self.path is not None:
            try:
                self.save(self.path)
            except OSError as exc:  # the answer is already made: keep it, keep learning in memory
                log.warning("could not save the member weights to %s (kept in memory): %s", self.path, exc)

    def observe_result(self, segments: Iterable[Any]) -> None:
        """:meth:`observe` the rewards recorded in a request's segments (``Segment.rewards``)."""
        rewards: dict[str, list[float]] = {}
        for seg in segments:
            for name, reward in zip(seg.verifiers, seg.rewards, strict=False):
                rewards.setdefault(name, []).append(float(reward))
        self.observe(rewards)

    def settled_after(self, tolerance: float = 0.02) -> int | None:
        """The first request count after which no member weight moved by more than ``tolerance``
        (absolute) to the last recorded member weights; ``None`` before two requests."""
        if len(self.history) < 2:
            return None
        final = self.history[-1]
        for n in range(1, len(self.history) + 1):
            later = self.history[n - 1 :]
            if all(abs(s.get(k, 0.0) - final.get(k, 0.0)) <= tolerance for s in later for k in final):
                return n
        return len(self.history)

    def prior_of(self, name: str) -> float:
        """Member ``name``'s prior: as given, else the mean of the given priors (1 without any)."""
        return self.prior.get(name, sum(self.prior.values()) / len(self.prior) if self.prior else 1.0)

    def _weights(self, names: Sequence[str]) -> list[float]:
        if not names:
            return []
        logs = []
        for name in names:
            seen = self.counts.get(name, 0)
            learned = self.learning_rate * self.cumulative.get(name, 0.0) / math.sqrt(seen) if seen else 0.0
            learned = max(-self.max_log_ratio, min(self.max_log_ratio, learned))
            logs.append(math.log(self.prior_of(name)) + learned)
        top = max(logs)
        raw = [math.exp(v - top) for v in logs]
        total = sum(raw)
        return [v / total for v in raw]

    # -- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON state (what :meth:`save` writes)."""
        with self._lock:
            return {
                "format": _FORMAT,
                "prior": dict(self.prior),
                "learning_rate": self.learning_rate,
                "max_log_ratio": self.max_log_ratio,
                "min_share": self.min_share,
                "cumulative": dict(self.cumulative),
                "requests": self.requests,
                "counts": dict(self.counts),
                "history": list(self.history),
            }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemberWeights:
        """Rebuild from :meth:`to_dict`'s output.

        Raises:
            ConfigError: not a member-weights state.
        """
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise ConfigError(f"not a SpecEM member-weights file (expected format {_FORMAT!r})")
        try:
            state = cls(
                data.get("prior") or {},
                learning_rate=data.get("learning_rate", 1.0),
                max_log_ratio=data.get("max_log_ratio", 4.0),
                min_share=data.get("min_share", 0.0),
            )
            state.cumulative = {str(k): float(v) for k, v in (data.get("cumulative") or {}).items()}
            state.requests = int(data.get("requests", 0))
            # states saved before per-member counts: every member took part in every request
            counts = data.get("counts") or dict.fromkeys(state.cumulative, state.requests)
            state.counts = {str(k): int(v) for k, v in counts.items()}
            state.history = [{str(k): float(v) for k, v in h.items()} for h in data.get("history") or []]
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"malformed SpecEM member-weights state: {exc}") from exc
        if (
            state.requests < 0
            or any(v < 0 for v in state.counts.values())
            or any(not math.isfinite(v) for v in state.cumulative.values())
        ):
            raise ConfigError("malformed SpecEM member-weights state: negative request count or non-finite reward")
        return state

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the state as JSON (atomically: a crash never leaves half a file)."""
        target = Path(path)
        with self._save_lock:  # snapshot and write together, so an older state never lands last
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(tmp, target)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MemberWeights:
        """Read a state written by :meth:`save`.

        Raises:
            ConfigError: the file is missing, not JSON, or not a member-weights state.
        """
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"member-weights file not found: {path}") from exc
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read member-weights file {path}: {exc}") from exc
        return cls.from_dict(data)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v:.3f}" for k, v in self.current().items())
        gate = f", min_share={self.min_share}" if self.min_share else ""
        return f"MemberWeights({shown}; requests={self.requests}, learning_rate={self.learning_rate}{gate})"
