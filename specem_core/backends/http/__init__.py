"""Members behind OpenAI-compatible HTTP servers, split by concern (after httpx's own layout).

* :mod:`~specem_core.backends.http.errors` — typed errors of server members.
* :mod:`~specem_core.backends.http.client` — transport: pooled ``httpx`` client, retries,
  ``Retry-After``, secret redaction, the sync-over-async bridge.
* :mod:`~specem_core.backends.http.alignment` — echo log-probs mapped onto candidate text spans.
* :mod:`~specem_core.backends.http.member` — :class:`OpenAIHTTPMember` and its session: drafting
  modes, probing, scoring, member specs.
* :mod:`~specem_core.backends.http.judge` — :class:`APIJudgeMember`: chat models as judges.

Nothing here imports the registry or the packaged models: a tokenizer is handed in by the caller
(:func:`specem_core.registry.load_member` resolves packaged names).
"""

from specem_core.backends.http.alignment import (
    EchoAlignment,
    EchoLogprobs,
    SpanScore,
    align_echo,
    parse_echo_logprobs,
    span_logprobs,
)
from specem_core.backends.http.client import Inflight, OpenAIClient, RetryPolicy, run_async, run_sync
from specem_core.backends.http.errors import (
    AlignmentError,
    CapabilityError,
    HTTPMemberError,
    RequestCancelledError,
    ServerResponseError,
)
from specem_core.backends.http.judge import (
    CANDIDATE_BLOCK,
    ENDS_NOTE,
    JUDGE_SYSTEM,
    JUDGE_USER,
    LABELS,
    APIJudgeMember,
    JudgeOptions,
    addresses_judge,
    judge_messages,
    judge_orders,
    judge_scores,
    label_probabilities,
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

__all__ = [
    "CANDIDATE_BLOCK",
    "CONTINUE_PROMPT",
    "ENDS_NOTE",
    "HTTP_SPEC_PREFIXES",
    "JUDGE_SYSTEM",
    "JUDGE_USER",
    "LABELS",
    "PREFILL_ANSWER",
    "PROBE_ANSWER",
    "PROBE_QUESTION",
    "APIJudgeMember",
    "AlignmentError",
    "CapabilityError",
    "DraftMode",
    "EchoAlignment",
    "EchoLogprobs",
    "HTTPMemberError",
    "Inflight",
    "JudgeOptions",
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
    "addresses_judge",
    "align_echo",
    "continuation_anchor",
    "is_http_spec",
    "judge_messages",
    "judge_orders",
    "judge_scores",
    "label_probabilities",
    "load_tokenizer",
    "member_from_spec",
    "parse_echo_logprobs",
    "run_async",
    "run_sync",
    "span_logprobs",
    "splice_continuation",
]
