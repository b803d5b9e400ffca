"""The API-judge fallback: closed chat models as verifiers (and, optionally, drafters).

Hosted chat APIs expose log-probs only for the tokens they generate, never for a prompt, so they
cannot score a candidate token by token. :class:`APIJudgeMember` uses such a model as a judge: an
:class:`~specem_core.backends.http.member.OpenAIHTTPMember` with ``verify_mode="judge"`` (the
prompt, the defences against position bias and against candidates that talk to the judge:
:mod:`specem_core.backends.http.judge_prompt`; the scoring round:
:func:`specem_core.backends.http.judge_scoring.judge_scores`).

The judge builds on the member: this module imports :mod:`~specem_core.backends.http.member`,
never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from specem_core.backends.http.member import OpenAIHTTPMember

if TYPE_CHECKING:
    import httpx
    from pydantic import SecretStr

    from specem_core.backends.http.client import RetryPolicy
    from specem_core.backends.http.judge_prompt import JudgeOptions
    from specem_core.backends.http.probe import DraftMode


class APIJudgeMember(OpenAIHTTPMember):
    """A chat model (typically closed: OpenAI, Anthropic-compatible gateways, …) as a judge.

    It verifies through the judge prompt and, with ``can_draft=True``, drafts through the
    documented continue-prompt (:data:`specem_core.backends.http.continuation.CONTINUE_PROMPT`).

    Example:
        >>> judge = APIJudgeMember("https://api.openai.com/v1", "gpt-4o-mini",
        ...                        api_key=os.environ["OPENAI_API_KEY"])      # doctest: +SKIP
        >>> engine = SpecEM([local_a, local_b, judge])                        # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        name: str | None = None,
        api_key: str | SecretStr | None = None,
        headers: Mapping[str, str | SecretStr] | None = None,
        timeout: float | httpx.Timeout = 120.0,
        retry: RetryPolicy | None = None,
        can_draft: bool = False,
        draft_mode: DraftMode = "chat_continue",
        judge: JudgeOptions | None = None,
        context_window: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            base_url,
            model,
            name=name,
            api_key=api_key,
            headers=headers,
            timeout=timeout,
            retry=retry,
            can_draft=can_draft,
            can_verify=True,
            draft_mode=draft_mode,
            verify_mode="judge",
            judge=judge,
            context_window=context_window,
            extra_body=extra_body,
            transport=transport,
            **kwargs,
        )
