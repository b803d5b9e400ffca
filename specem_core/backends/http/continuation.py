"""Continuing an answer through a chat API that cannot prefill (``draft_mode="chat_continue"``).

The partial answer is shown back with :data:`CONTINUE_PROMPT`, the model is asked to repeat its
last words (:func:`continuation_anchor`) and go on, and the reply is spliced onto the answer at
that overlap (:func:`splice_continuation`).
"""

from __future__ import annotations

CONTINUE_PROMPT = (
    "Your previous answer was cut off. Here is the part written so far, between <partial> tags:\n"
    "<partial>{partial}</partial>\n"
    "Continue it from exactly where it stops. Start your reply by repeating its last words "
    '"{anchor}" exactly, then go on with the rest of the answer. Do not restart the answer, do not '
    "add any comment, and do not use the tags."
)
"""Shown to chat models that cannot continue an assistant message (members guide, "A closed model as a judge").
The reply is spliced onto the answer at the repeated words (:func:`splice_continuation`)."""


def continuation_anchor(partial: str, words: int = 3, max_chars: int = 40) -> str:
    """The last few words of ``partial`` that the model is asked to repeat."""
    tail = partial[-max_chars:]
    parts = tail.rstrip().split(" ")
    anchor = " ".join(parts[-words:]) if len(parts) > words else tail.rstrip()
    return anchor.lstrip()


def splice_continuation(partial: str, reply: str, anchor: str) -> str:
    """The new text to append to ``partial``, from a reply that (ideally) starts with ``anchor``.

    1. The reply repeats the anchor near its start: everything after it.
    2. The reply starts with some other tail of the partial answer (>= 4 characters): the rest.
    3. Otherwise the reply is taken as is, with a space inserted between two words.
    """
    if not partial:
        return reply
    if anchor:
        idx = reply.find(anchor, 0, len(anchor) + 12)
        if idx != -1 and not reply[:idx].strip(" \"'`*.…"):
            rest = reply[idx + len(anchor) :]
            trailing = partial[len(partial.rstrip()) :]
            return rest.lstrip() if trailing and rest.startswith((" ", "\n")) else rest
    stripped = reply.lstrip()
    for n in range(min(len(partial), len(stripped)), 3, -1):
        if partial.endswith(stripped[:n]):
            return stripped[n:]
    if partial[-1:].isalnum() and stripped[:1].isalnum():
        return " " + stripped
    if partial[-1:] in ",.;:!?)" and stripped[:1].isalnum():
        return " " + stripped
    return stripped if partial[-1:].isspace() else reply
