"""SpecEM: segment-level ensembling of LLMs while they generate (NeurIPS 2025).

Heavy dependencies (torch, transformers) are imported only when a local model is loaded, so
``import specem_core`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specem_core.backends.base import Member, MemberSession, SamplingParams, SessionRequest
from specem_core.config import SpecEMConfig
from specem_core.engine import CandidateFilter, SpecEM, default_engine
from specem_core.errors import (
    AllMembersFailedError,
    ConfigError,
    ContextWindowError,
    InputError,
    MemberError,
    ModelNotFoundError,
    SpecEMError,
)
from specem_core.types import (
    Candidate,
    CandidateScore,
    Draft,
    Exclusion,
    GenerationResult,
    InvalidToolCall,
    MemberUsage,
    Segment,
    StreamEvent,
    ToolCall,
    Trusted,
    Usage,
)
from specem_core.weights import MemberWeights

if TYPE_CHECKING:
    from specem_core.backends.http.judge import APIJudgeMember
    from specem_core.backends.http.member import OpenAIHTTPMember
    from specem_core.backends.transformers import TransformersMember

__version__ = "0.1.0"

__all__ = [
    "APIJudgeMember",
    "AllMembersFailedError",
    "Candidate",
    "CandidateFilter",
    "CandidateScore",
    "ConfigError",
    "ContextWindowError",
    "Draft",
    "Exclusion",
    "GenerationResult",
    "InputError",
    "InvalidToolCall",
    "Member",
    "MemberError",
    "MemberSession",
    "MemberUsage",
    "MemberWeights",
    "ModelNotFoundError",
    "OpenAIHTTPMember",
    "SamplingParams",
    "Segment",
    "SessionRequest",
    "SpecEM",
    "SpecEMConfig",
    "SpecEMError",
    "StreamEvent",
    "ToolCall",
    "TransformersMember",
    "Trusted",
    "Usage",
    "__version__",
    "default_engine",
    "get_preset",
    "load_member",
    "preset_names",
]


def __getattr__(name: str) -> Any:
    # Lazy: importing torch/transformers costs seconds; only pay it when a local model is used.
    if name == "TransformersMember":
        from specem_core.backends.transformers import TransformersMember

        return TransformersMember
    if name == "OpenAIHTTPMember":  # httpx only; kept lazy so that `import specem_core` stays light
        from specem_core.backends.http.member import OpenAIHTTPMember

        return OpenAIHTTPMember
    if name == "APIJudgeMember":
        from specem_core.backends.http.judge import APIJudgeMember

        return APIJudgeMember
    if name == "load_member":
        from specem_core import registry

        return registry.load_member
    if name in ("get_preset", "preset_names"):
        from specem_core import presets

        return getattr(presets, name)
    raise AttributeError(f"module 'specem_core' has no attribute {name!r}")
