"""How a server member drafts and verifies, decided from what its probe found
(:class:`~specem_core.backends.http.probe.ServerCapabilities`) and what the member asked for:
:func:`draft_mode_for` and :func:`verify_mode_for`. A mode asked for by name that the server does
not offer raises :class:`~specem_core.backends.http.errors.CapabilityError`; ``auto`` takes the best
the server offers, and says so where that is less than exact."""

from __future__ import annotations

from specem_core.backends.http.client import log
from specem_core.backends.http.errors import CapabilityError
from specem_core.backends.http.probe import (
    SCORE_PATHS,
    DraftMode,
    PromptSource,
    ScorePath,
    ServerCapabilities,
    VerifyMode,
)


def draft_mode_for(
    name: str, draft_mode: DraftMode, can_draft: bool, caps: ServerCapabilities, prompt_source: PromptSource
) -> DraftMode:
    """``auto``: completions when the prompt text is exact, else chat prefill, else chat
    continuation, else plain-format completions; a named mode must be offered."""
    draft: DraftMode = draft_mode
    if draft == "auto":
        if caps.completions and prompt_source != "plain":
            draft = "completions"
        elif caps.chat_prefill:
            draft = "chat_prefill"
        elif caps.chat:
            draft = "chat_continue"
        elif caps.completions:
            draft = "completions"
        elif can_draft:
            raise CapabilityError(f"{name}: the server offers neither completions nor chat completions")
    elif can_draft:
        need = {"completions": caps.completions, "chat_prefill": bool(caps.chat_prefill), "chat_continue": caps.chat}
        if not need[draft]:
            raise CapabilityError(f"{name}: draft_mode={draft!r} is not supported by the server")
    return draft


def verify_mode_for(
    name: str, verify_mode: VerifyMode, caps: ServerCapabilities
) -> tuple[VerifyMode | None, ScorePath | None]:
    """(verify mode, exact scoring path) of a member that verifies: the named path or the judge
    when asked for, else the fastest exact path, else (``auto``) the judge, with a warning, else
    ``(None, None)``: the member cannot verify (warned)."""
    exact = caps.score_paths
    judge_ok = bool(caps.chat and caps.chat_logprobs)
    mode = verify_mode
    if mode in SCORE_PATHS and mode not in exact:
        offered = ", ".join(exact) or "no exact path"
        raise CapabilityError(f"{name}: verify_mode={mode!r} is not supported by the server ({offered})")
    if mode == "logprobs" and not exact:
        raise CapabilityError(f"{name}: verify_mode='logprobs' needs an exact scoring path (none found)")
    if mode == "judge" and not judge_ok:
        raise CapabilityError(f"{name}: verify_mode='judge' needs chat completions with logprobs")
    if mode == "judge":
        return "judge", None
    if mode in SCORE_PATHS:
        return "logprobs", next(p for p in SCORE_PATHS if p == mode)
    if exact:
        return "logprobs", exact[0]
    if mode == "auto" and judge_ok:
        log.warning(
            "%s: the server offers no exact scoring path (%s); the member verifies as a judge, an "
            "approximate preference read from a chat answer's top log-probs. Pass verify_mode='logprobs' "
            "to refuse anything inexact instead.",
            name,
            "; ".join(caps.notes) or "no echo, prompt-tail, next-token or forced log-probs",
        )
        return "judge", None
    log.warning(
        "%s: the server exposes no log-probs; the member will not verify (it drafts only). Pass "
        "verify_mode='logprobs' to refuse such a server instead.",
        name,
    )
    return None, None


def warn_plain_prompt(name: str, model: str | None, draft: DraftMode | None) -> None:
    """The warning of a member that has no chat template (its text is not the model's own)."""
    log.warning(
        "%s: no chat template for model %r: none was given, none was found for the served model id on "
        "this machine (a packaged model's name, a .gguf file, a tokenizer directory, an HF id in the "
        "local cache), and the server does not render conversations; drafts go through %s and scores "
        "use the plain prompt format, so the text is not the model's own at segment boundaries. Pass "
        "tokenizer=<HF id or tokenizer directory> (load_member / OpenAIHTTPMember), or serve the model "
        "under the name of a packaged model or of an HF id in the local cache.",
        name,
        model,
        draft if draft is not None else "no draft",
    )
