"""What probing a server decides (its result, no requests): capabilities, modes, scoring paths.

Probing is done from a few requests before the first draft; the requests themselves are
:mod:`specem_core.backends.http.probing`'s.

:class:`ServerCapabilities` is what :meth:`~specem_core.backends.http.member.OpenAIHTTPMember.probe`
finds: the server software (from ``/v1/models``), echo log-probs and whether they are shifted by
one position (:func:`decide_shift` on the echo of :data:`PROBE_ANSWER`), what ``max_tokens=0``
means, assistant prefill and chat log-probs, the server's own tokenizer endpoint (and whether it
renders a conversation), and the exact scoring paths (:data:`ScorePath`) it offers, fastest first.
The member resolves its draft and verify modes (:data:`DraftMode`, :data:`VerifyMode`) and its
scoring path from it.

The scoring paths, all exact (the mean log-prob of the candidate's tokens as the server tokenizes
``prompt + answer + candidate``):

* ``"echo"``: ``/v1/completions`` with ``echo`` and ``logprobs``: prompt log-probs of the whole
  request. vLLM computes prompt log-probs only in a full prefill (it skips *reading* its prefix
  cache for them); llama-cpp-python reuses its KV prefix but lists every prompt position in Python
  (a sort of the whole vocabulary per position): both cost the whole prompt, every round.
* ``"prompt_tail"`` (vLLM, served with ``--enable-scale-out`` and ``--enable-prompt-tokens-details``):
  one request per candidate to vLLM's token-in-token-out endpoint (``/inference/v1/generate``), the
  token ids of ``prompt + answer + candidate`` with prompt log-probs and
  ``skip_reading_prefix_cache: false``: the server reads its prefix cache in whole blocks and
  computes the rest, so the candidate's log-probs are those of the computed tail (the positions
  read from the cache come back without values: ``cached_tokens`` says where they end; a candidate
  token among them is asked for on the ``next_token`` path). One forward pass over the tail per
  candidate.
* ``"next_token"`` (vLLM): one ``/v1/completions`` request per candidate token, its prompt the
  token ids up to that token, ``logprob_token_ids`` naming it: every request reads the prefix
  cache and computes the tail since its last full cache block; the tokens of the member's own
  draft are scored from the draft's own log-probs.
* ``"forced"`` (llama-cpp-python): the candidate's tokens forced through a grammar of token ids
  (``<[id]>``), streamed with ``logprobs``: the log-probs of the generated tokens, the prompt read
  from the server's KV prefix. Such a server never reports the log-prob of an end-of-turn token it
  generates, so that one term is taken from an echo where the echo is aligned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from specem_core.backends.http.alignment import EchoLogprobs, align_echo, top_token
from specem_core.backends.http.errors import HTTPMemberError

DraftMode = Literal["auto", "completions", "chat_prefill", "chat_continue"]
ScorePath = Literal["echo", "prompt_tail", "next_token", "forced"]
"""How an exact verifier gets its log-probs (module docstring)."""
VerifyMode = Literal["auto", "logprobs", "echo", "prompt_tail", "next_token", "forced", "judge"]
"""``auto``: the fastest exact path, else the judge; ``logprobs``: the fastest exact path;
``echo`` / ``prompt_tail`` / ``next_token`` / ``forced``: that exact path; ``judge``: a labelled-choice judge."""
SCORE_PATHS: tuple[ScorePath, ...] = ("echo", "prompt_tail", "next_token", "forced")
CACHE_PATHS: tuple[ScorePath, ...] = ("prompt_tail", "next_token", "forced")
"""The paths that read the server's prefix cache (:mod:`specem_core.backends.http.token_scoring`)."""
ServerKind = Literal["vllm", "sglang", "llama-cpp-python", "llama.cpp", "openai", "generic"]
MaxTokensZero = Literal["zero", "unlimited", "rejected", "unknown"]
TokenizeAPI = Literal["vllm", "llama-cpp-python", "llama.cpp"]
"""The server's own tokenizer endpoint: vLLM's ``/tokenize`` (text or messages) and
``/detokenize``; llama-cpp-python's ``/extras/tokenize``; llama-server's ``/tokenize`` (text, with
each token's piece) and ``/apply-template`` (a conversation)."""
PromptSource = Literal["local", "server", "plain"]
"""Where a member's prompt text comes from: its own chat template (``local``), the server
rendering the conversation (``server``: vLLM's ``/tokenize`` with messages), or the plain format."""


@dataclass(frozen=True)
class ServerCapabilities:
    """What a server was found to support (see :meth:`OpenAIHTTPMember.probe`)."""

    server: ServerKind = "generic"
    model: str | None = None
    context_window: int | None = None
    completions: bool = False
    chat: bool = False
    echo_logprobs: bool = False
    echo_shift: int | None = None
    """0: echo log-probs aligned; 1: shifted by one (corrected); None: not usable."""
    max_tokens_zero: MaxTokensZero = "unknown"
    chat_prefill: bool | None = None
    chat_logprobs: bool | None = None
    tokenize: TokenizeAPI | None = None
    """The server's tokenizer endpoint, if any."""
    renders_messages: bool = False
    """The server renders a conversation with the model's chat template (vLLM's ``/tokenize``)."""
    next_token_logprobs: bool = False
    """``logprob_token_ids`` on ``/v1/completions`` with a token-id prompt (vLLM)."""
    prompt_tail: bool = False
    """Prompt log-probs that read the prefix cache on ``/inference/v1/generate`` (vLLM
    ``--enable-scale-out``)."""
    token_grammar: bool = False
    """A grammar of token ids (``root ::= <[id]> ...``) forces exactly those tokens (llama.cpp)."""
    reports_cached_tokens: bool = False
    """``usage.prompt_tokens_details.cached_tokens`` in answers (vLLM ``--enable-prompt-tokens-details``)."""
    score_paths: tuple[ScorePath, ...] = ()
    """The exact scoring paths this server offers, fastest first (module docstring)."""
    scoring_probed: bool = False
    """Whether the scoring half of the probe ran (``score_paths``, echo, chat log-probs): a member
    that never verifies in a request (one member alone) never asks."""
    notes: tuple[str, ...] = ()

    @property
    def score_path(self) -> ScorePath | None:
        """The fastest exact scoring path (what ``verify_mode="auto"`` uses), or ``None``."""
        return self.score_paths[0] if self.score_paths else None

    @property
    def scoring_reads_cache(self) -> bool:
        """Whether verification on the fastest path reads the server's prefix cache."""
        return self.score_path in CACHE_PATHS


def without_scoring(caps: ServerCapabilities) -> ServerCapabilities:
    """``caps`` with what the scoring half of the probe found forgotten (to be asked again)."""
    return replace(
        caps,
        echo_logprobs=False,
        echo_shift=None,
        max_tokens_zero="unknown",
        next_token_logprobs=False,
        prompt_tail=False,
        token_grammar=False,
        reports_cached_tokens=False,
        score_paths=(),
        scoring_probed=False,
    )


PROBE_QUESTION = "Count from 1 to 40, separated by commas."
PROBE_ANSWER = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13"
"""A continuation every instruct model predicts token by token: echo log-probs whose top-1
prediction matches the *next* echoed token are shifted by one."""
PREFILL_ANSWER = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
PROBE_SCORED = "1, 2, 3"
"""What the scoring paths' probes score after the probe question: a few tokens (on
llama-cpp-python every listed log-prob costs a sort of the vocabulary in Python, about 0.2 s)."""
SHORT_ECHO = ("one two three", " four five")
"""The forced path's probe text and the words it scores after it, echoed too: where a server
forces tokens (llama.cpp), the echo's alignment is decided by comparing the two
(:func:`decide_shift_by_values`) on a few tokens instead of the predictions of a long echo."""


def root_url(base_url: str) -> str:
    """The server's root (``http://host:port``) from the API root (``http://host:port/v1``): the
    tokenizer endpoints live beside ``/v1``, not under it."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def server_kind(models_body: Any) -> tuple[ServerKind, list[dict[str, Any]]]:
    """The server software, from the owners ``/v1/models`` lists, and the listed entries."""
    data = models_body.get("data") if isinstance(models_body, dict) else None
    entries = [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []
    owners = {str(d.get("owned_by", "")).lower() for d in entries}
    kind: ServerKind = "generic"
    if "vllm" in owners:
        kind = "vllm"
    elif "sglang" in owners:
        kind = "sglang"
    elif "me" in owners:
        kind = "llama-cpp-python"
    elif "llamacpp" in owners:
        kind = "llama.cpp"
    elif owners & {"openai", "system", "openai-internal"}:
        kind = "openai"
    return kind, entries


def context_from_models(entries: Sequence[Mapping[str, Any]], model: str | None) -> int | None:
    """The context window ``/v1/models`` reports for ``model`` (any entry when ``None``)."""
    for d in entries:
        if model is not None and d.get("id") != model:
            continue
        for key in ("max_model_len", "context_length", "context_window", "n_ctx"):
            value = d.get(key) or (d.get("meta") or {}).get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def decide_shift(sent: str, prompt_len: int, echo: EchoLogprobs) -> int | None:
    """From the echo of the probe (``sent`` = prompt + :data:`PROBE_ANSWER`): 0 when each token's
    log-prob slot predicts that token, 1 when it predicts the next one, ``None`` when neither is clear."""
    alignment = align_echo(sent, echo, region_start=prompt_len, text_end=len(sent))
    idx = alignment.text_entries
    aligned = shifted = total = 0
    for n, j in enumerate(idx[:-1]):
        if n < 3:
            continue  # the first numbers are not predictable yet
        top = top_token(echo.top_logprobs[j])
        if top is None:
            continue
        total += 1
        aligned += top == echo.tokens[j]
        shifted += top == echo.tokens[idx[n + 1]]
    if total < 6:
        return None
    if aligned >= 0.6 * total and aligned >= 2 * shifted + 1:
        return 0
    if shifted >= 0.6 * total and shifted >= 2 * aligned + 1:
        return 1
    return None


def decide_shift_by_values(
    sent: str, region_start: int, echo: EchoLogprobs, exact: Sequence[float], tolerance: float = 0.1
) -> int | None:
    """From the echo of ``sent`` (one token generated greedily after it), whose text from
    ``region_start`` on was also scored exactly (``exact``: its tokens' log-probs, from the forced
    path): 0 when each echoed token's own log-prob is the exact one; 1 when none is, the last
    prompt slot's top token is the one generated after it (the slots are one ahead: llama-cpp-python
    without a BOS at the start) and every text token the slot before it lists has the exact
    value; ``None`` otherwise."""
    alignment = align_echo(sent, echo, region_start=region_start, text_end=len(sent))
    idx = alignment.text_entries
    if not idx or len(idx) != len(exact):
        return None
    own = [echo.token_logprobs[j] for j in idx]
    if all(v is not None and abs(v - x) <= tolerance for v, x in zip(own, exact, strict=True)):
        return 0
    if any(v is not None and abs(v - x) <= tolerance for v, x in zip(own, exact, strict=True)):
        return None
    generated = echo.text[len(sent) :]
    last = echo.top_logprobs[idx[-1]]
    if not generated or not isinstance(last, dict) or top_token(last) is None:
        return None
    if not generated.startswith(str(top_token(last))):
        return None
    for n, j in enumerate(idx):
        previous = echo.top_logprobs[j - 1] if j >= 1 else None
        value = previous.get(echo.tokens[j]) if isinstance(previous, dict) else None
        if value is not None and abs(value - exact[n]) > tolerance:
            return None
    return 1


def is_fatal(exc: HTTPMemberError) -> bool:
    """Probe failures that say nothing about features: unreachable, auth, rate limit, server error."""
    return exc.status is None or exc.status >= 500 or exc.status in (401, 403, 407, 429)
