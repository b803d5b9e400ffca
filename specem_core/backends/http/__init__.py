"""Members behind OpenAI-compatible HTTP servers, split by concern (after httpx's own layout).

Import each name from its module (this package re-exports nothing: one import path per name).
Each module imports only those listed before it:

* :mod:`~specem_core.backends.http.errors` — typed errors of server members.
* :mod:`~specem_core.backends.http.client` — transport: pooled ``httpx`` client, retries,
  ``Retry-After``, secret redaction, the sync-over-async bridge.
* :mod:`~specem_core.backends.http.alignment` — echo log-probs mapped onto candidate text spans.
* :mod:`~specem_core.backends.http.judge_prompt` — the judge verify mode's prompt, options
  (:class:`~specem_core.backends.http.judge_prompt.JudgeOptions`) and label probabilities.
* :mod:`~specem_core.backends.http.member` — :class:`~specem_core.backends.http.member.OpenAIHTTPMember`
  and its session: drafting modes, probing, scoring (log-probs or the judge).
* :mod:`~specem_core.backends.http.judge` — :class:`~specem_core.backends.http.judge.APIJudgeMember`:
  chat models as judges, built on the member.
* :mod:`~specem_core.backends.http.factory` — member specs (``openai:…`` / ``judge:…``):
  :func:`~specem_core.backends.http.factory.member_from_spec` builds either kind.

Nothing here imports the registry or the packaged models: a tokenizer is handed in by the caller
(:func:`specem_core.registry.load_member` resolves packaged names).
"""
