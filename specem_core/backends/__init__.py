"""Backends: one module (or package, like ``http/``) each, all behind :mod:`specem_core.backends.base`."""

from specem_core.backends.base import Member, MemberSession, SamplingParams, SessionRequest

__all__ = ["Member", "MemberSession", "SamplingParams", "SessionRequest"]
