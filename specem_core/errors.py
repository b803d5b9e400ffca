"""Typed errors raised by SpecEM.

Every error names the problem in one line so that the CLI and the integrations can show it as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class SpecEMError(Exception):
    """Base class of every error SpecEM raises on purpose."""


class ConfigError(SpecEMError, ValueError):
    """A configuration value is out of range or inconsistent."""


class InputError(SpecEMError, ValueError):
    """The request itself is unusable (empty prompt, unknown role, malformed message)."""


class ContextWindowError(InputError):
    """The prompt does not fit in a member's context window."""


class ModelNotFoundError(SpecEMError, LookupError):
    """A member name, path or model id could not be resolved to loadable weights."""


class MemberError(SpecEMError, RuntimeError):
    """A member failed while drafting, scoring or committing (after its retries)."""

    def __init__(self, member: str, stage: str, message: str) -> None:
        super().__init__(f"member {member!r} failed while {stage}: {message}")
        self.member = member
        """The failing member's name."""
        self.stage = stage
        """What it was doing when it failed, as the message words it (``"scoring"``: "failed while scoring")."""


class AllMembersFailedError(SpecEMError, RuntimeError):
    """Every member that could draft was excluded; no answer can be produced."""

    def __init__(self, message: str, excluded: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.excluded: tuple[Any, ...] = tuple(excluded)
        """The request's exclusions (:class:`~specem_core.types.Exclusion`: member, stage, error,
        round), as a result would have reported them (``specem serve`` counts them)."""
