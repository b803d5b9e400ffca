"""Members from one-line specs: ``openai:<base_url>[#model]`` and ``judge:<base_url>#model``.

The factory builds either kind of server member, so it sits above both
:mod:`~specem_core.backends.http.member` and :mod:`~specem_core.backends.http.judge` (the judge
builds on the member; neither imports this module). :func:`specem_core.registry.load_member`
calls :func:`member_from_spec` for these specs.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import SecretStr

from specem_core.backends.http.judge import APIJudgeMember
from specem_core.backends.http.member import OpenAIHTTPMember
from specem_core.errors import ModelNotFoundError

HTTP_SPEC_PREFIXES = ("openai:", "judge:")


def is_http_spec(spec: str) -> bool:
    """True for member specs of the form ``openai:<base_url>[#model]`` / ``judge:<base_url>#model``."""
    return spec.strip().startswith(HTTP_SPEC_PREFIXES)


def member_from_spec(spec: str, *, api_key_env: str | None = None, **kwargs: Any) -> OpenAIHTTPMember:
    """A member from a one-line spec (for the CLI's ``--model`` and :func:`~specem_core.load_member`).

    * ``openai:http://gpu-1:8000/v1#Qwen/Qwen2.5-7B-Instruct`` — an OpenAI-compatible server
      (drafts and verifies; the model id after ``#`` is optional).
    * ``judge:https://api.openai.com/v1#gpt-4o-mini`` — a chat model as a judge only.

    The API key is never part of the spec: pass ``api_key=`` or name an environment variable with
    ``api_key_env=`` (it is read only when named, so a key is never sent to a server by accident).

    Raises:
        ModelNotFoundError: the spec is not of this form.
    """
    text = spec.strip()
    kind, _, rest = text.partition(":")
    if kind not in ("openai", "judge") or not rest.startswith(("http://", "https://")):
        raise ModelNotFoundError(f"not an HTTP member spec: {spec!r} (use openai:<base_url>#<model>)")
    base_url, _, model = rest.partition("#")
    if api_key_env is not None:
        value = os.environ.get(api_key_env)
        if not value:
            raise ModelNotFoundError(f"environment variable {api_key_env} (the API key) is not set")
        kwargs.setdefault("api_key", SecretStr(value))
    if kind == "judge":
        return APIJudgeMember(base_url, model or None, **kwargs)
    return OpenAIHTTPMember(base_url, model or None, **kwargs)
