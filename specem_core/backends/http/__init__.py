"""Members behind OpenAI-compatible HTTP servers, split by concern (after httpx's own layout).

Import each name from its module (this package re-exports nothing: one import path per name).
Each module imports only those listed before it (``tests/test_layers.py`` and the ``http-layers``
import contract keep it so):

* :mod:`~specem_core.backends.http.errors` — typed errors of server members.
* :mod:`~specem_core.backends.http.client` — transport: pooled ``httpx`` client, retries,
  ``Retry-After``, secret redaction, the sync-over-async bridge.
* :mod:`~specem_core.backends.http.responses` — reading answers: the first choice, log-prob
  values, a chat answer's text and first-token alternatives.
* :mod:`~specem_core.backends.http.alignment` — echo log-probs mapped onto candidate text spans.
* :mod:`~specem_core.backends.http.judge_prompt` — the judge verify mode's prompt, options
  (:class:`~specem_core.backends.http.judge_prompt.JudgeOptions`) and label probabilities.
* :mod:`~specem_core.backends.http.probe` — what probing a server decides
  (:class:`~specem_core.backends.http.probe.ServerCapabilities`, the draft and verify modes, the
  scoring paths); the requests that decide it are :mod:`~specem_core.backends.http.probing`'s.
* :mod:`~specem_core.backends.http.continuation` — continuing an answer through a chat API that
  cannot prefill (the continue-prompt and the splice).
* :mod:`~specem_core.backends.http.tokenizer` — the member's optional local tokenizer.
* :mod:`~specem_core.backends.http.interface` — what a session needs of its member (a protocol)
  and the member's counters.
* :mod:`~specem_core.backends.http.probe_cache` — what probes found, kept per server in the
  process and on disk (a new process asks its servers nothing it asked before).
* :mod:`~specem_core.backends.http.modes` — the draft and verify modes decided from what a probe
  found.
* :mod:`~specem_core.backends.http.judge_scoring` — the judge verify mode's round.
* :mod:`~specem_core.backends.http.token_scoring` — exact scoring that reads the server's prefix
  cache (the ``prompt_tail``, ``next_token`` and ``forced`` scoring paths).
* :mod:`~specem_core.backends.http.session` — one request: drafting in the member's draft mode,
  scoring with exact log-probs or the judge.
* :mod:`~specem_core.backends.http.probing` — the probe's requests, asked through the member's
  protocol the way drafting and scoring will ask.
* :mod:`~specem_core.backends.http.member` — :class:`~specem_core.backends.http.member.OpenAIHTTPMember`:
  configuration, probing requests, request bodies in the server's dialect.
* :mod:`~specem_core.backends.http.judge` — :class:`~specem_core.backends.http.judge.APIJudgeMember`:
  chat models as judges, built on the member.
* :mod:`~specem_core.backends.http.factory` — member specs (``openai:…`` / ``judge:…``):
  :func:`~specem_core.backends.http.factory.member_from_spec` builds either kind.

Nothing here imports the registry or the packaged models: a tokenizer is handed in by the caller
(:func:`specem_core.registry.load_member` resolves packaged names).
"""
