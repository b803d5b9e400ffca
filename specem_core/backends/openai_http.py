"""Compatibility re-exports: the HTTP backend now lives in :mod:`specem_core.backends.http`.

``errors`` (typed errors), ``client`` (transport, retries, redaction, sync-over-async bridge),
``alignment`` (echo log-probs onto candidate spans), ``member`` (:class:`OpenAIHTTPMember`, its
session, probing, member specs) and ``judge`` (:class:`~specem_core.backends.http.judge.APIJudgeMember`).
Existing ``from specem_core.backends.openai_http import …`` imports keep working.

One difference: :func:`load_tokenizer` (and ``OpenAIHTTPMember(tokenizer=…)``) no longer turns a
packaged model name into its converted directory — the registry does
(:func:`specem_core.registry.resolve_tokenizer`; ``load_member("openai:…", tokenizer="smollm2")``
applies it).
"""

from specem_core.backends.http.alignment import (
    EchoAlignment,
    EchoLogprobs,
    SpanScore,
    align_echo,
    parse_echo_logprobs,
    span_logprobs,
)
from specem_core.backends.http.client import (
    Inflight,
    OpenAIClient,
    RetryPolicy,
    log,
    run_async,
    run_sync,
)
from specem_core.backends.http.client import _gather as _gather
from specem_core.backends.http.errors import (
    AlignmentError,
    CapabilityError,
    HTTPMemberError,
    RequestCancelledError,
    ServerResponseError,
)
from specem_core.backends.http.member import (
    CONTINUE_PROMPT,
    HTTP_SPEC_PREFIXES,
    PREFILL_ANSWER,
    PROBE_ANSWER,
    PROBE_QUESTION,
    DraftMode,
    MaxTokensZero,
    MemberStats,
    OpenAIHTTPMember,
    OpenAIHTTPSession,
    ServerCapabilities,
    ServerKind,
    VerifyMode,
    continuation_anchor,
    is_http_spec,
    load_tokenizer,
    member_from_spec,
    splice_continuation,
)
from specem_core.backends.http.member import _chat_top_logprobs as _chat_top_logprobs

__all__ = [
    "CONTINUE_PROMPT",
    "HTTP_SPEC_PREFIXES",
    "PREFILL_ANSWER",
    "PROBE_ANSWER",
    "PROBE_QUESTION",
    "AlignmentError",
    "CapabilityError",
    "DraftMode",
    "EchoAlignment",
    "EchoLogprobs",
    "HTTPMemberError",
    "Inflight",
    "MaxTokensZero",
    "MemberStats",
    "OpenAIClient",
    "OpenAIHTTPMember",
    "OpenAIHTTPSession",
    "RequestCancelledError",
    "RetryPolicy",
    "ServerCapabilities",
    "ServerKind",
    "ServerResponseError",
    "SpanScore",
    "VerifyMode",
    "align_echo",
    "continuation_anchor",
    "is_http_spec",
    "load_tokenizer",
    "log",
    "member_from_spec",
    "parse_echo_logprobs",
    "run_async",
    "run_sync",
    "span_logprobs",
    "splice_continuation",
]
