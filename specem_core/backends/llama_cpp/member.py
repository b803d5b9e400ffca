"""A GGUF model as a SpecEM member: its chat format, tokenizer helpers and sessions."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from specem_core.backends._local import LocalVocabulary
from specem_core.backends.base import SessionRequest
from specem_core.backends.llama_cpp._binding import CANDIDATE_ROOM
from specem_core.backends.llama_cpp._shared import SharedStats
from specem_core.backends.llama_cpp.model import LlamaCppModel
from specem_core.backends.llama_cpp.session import LlamaCppSession
from specem_core.chat_format import ChatFormat, JinjaChatTemplate
from specem_core.errors import ModelNotFoundError


class LlamaCppMember(LocalVocabulary):
    """A GGUF model run by llama.cpp in process, as a SpecEM member.

    Example:
        >>> member = LlamaCppMember.from_gguf("qwen2.5-coder-0.5b-instruct.gguf")     # doctest: +SKIP
        >>> model = LlamaCppModel("model.gguf", n_ctx=16384)                           # doctest: +SKIP
        >>> a = LlamaCppMember(model, name="a"); b = LlamaCppMember(model, name="b")   # shared weights

    Args:
        model: a loaded :class:`LlamaCppModel` (shareable between members and requests).
        name: unique name in the ensemble (default: the GGUF's ``general.name``).
        can_draft / can_verify: the member's roles.
        chat_template: overrides the GGUF's ``tokenizer.chat_template``; a model without one uses
            the plain format of :mod:`specem_core.chat_format`.
    """

    def __init__(
        self,
        model: LlamaCppModel,
        *,
        name: str | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self.model = model
        """The loaded GGUF (weights shared by every member and request that use it)."""
        self.name = name or model.name
        """Unique name in the ensemble: traces, weights and usage are keyed by it."""
        self.can_draft = can_draft
        """This member proposes candidates."""
        self.can_verify = can_verify
        """This member scores candidates."""
        template = chat_template or model.chat_template
        bos = model.token_text(model.bos_id) if model.bos_id >= 0 else ""
        eos = model.token_text(model.eos_id) if model.eos_id >= 0 else ""
        self.chat = ChatFormat(JinjaChatTemplate(template, bos, eos) if template else None, template)
        self.stop_ids = model.end_of_generation_ids()
        self.eot_id = self._find_end_of_turn()
        control = 1 << 3  # LLAMA_TOKEN_ATTR_CONTROL
        # Control tokens other than the end of turn never belong in a drafted answer.
        self.suppress_ids = sorted(
            t for t, attr in enumerate(model.token_attrs()) if attr & control and t not in self.stop_ids
        )

    def __repr__(self) -> str:
        return (
            f"LlamaCppMember(name={self.name!r}, path={str(self.model.path)!r}, "
            f"draft={self.can_draft}, verify={self.can_verify})"
        )

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        can_draft: bool = True,
        can_verify: bool = True,
        chat_template: str | None = None,
        **model_kwargs: Any,
    ) -> LlamaCppMember:
        """Load ``path`` (keyword arguments go to :class:`LlamaCppModel`: ``n_ctx``, ``n_threads``…)."""
        model = LlamaCppModel(path, **model_kwargs)
        return cls(model, name=name, can_draft=can_draft, can_verify=can_verify, chat_template=chat_template)

    # -- Member protocol --------------------------------------------------------------------
    @property
    def context_window(self) -> int | None:
        """Tokens one request may use: a context's cells less room for one round of candidates."""
        return self.model.n_ctx - min(CANDIDATE_ROOM, self.model.n_ctx // 2)

    @property
    def draft_cost(self) -> int:
        """Relative cost of a drafted token: the GGUF's size (the engine lets cheaper members draft
        first, so that costlier ones can reuse their tokens; ``SpecEMConfig.reuse_other_drafts``)."""
        return self.model.info.file_size  # read once, when the model was validated

    @property
    def concurrency_key(self) -> str:
        """All llama.cpp members of a process share its CPUs: within a request they run one after another."""
        return "llamacpp:cpu"

    @property
    def shared_stats(self) -> SharedStats | None:
        """With ``continuous_batching``: what the model's shared decode calls did so far (shared by
        the members on this model); ``None`` otherwise."""
        shared = self.model.shared
        return shared.stats if shared is not None else None

    def settle(self, timeout: float = 30.0) -> None:
        """Wait (at most ``timeout`` seconds) for the background prefix-cache copies to end
        (``SettlingMember``: a process should not exit while one runs inside llama.cpp)."""
        self.model.settle(timeout)

    def open(self, request: SessionRequest) -> LlamaCppSession:
        """Render and encode the prompt; the prefill waits for the first draft or score."""
        return LlamaCppSession(self, request)

    # -- tokenizer helpers ------------------------------------------------------------------
    def _tokenize_prompt(self, text: str, add_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=True)

    def encode_response(self, text: str) -> list[int]:
        """Canonical ids of the response text (no special tokens are parsed in model output)."""
        return self.model.tokenize(text, add_special=False, parse_special=False) if text else []

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.model.piece(t) for t in ids)

    def _token_texts(self) -> list[str]:
        return self.model.piece_texts()

    def _decode_text(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _find_end_of_turn(self) -> int:
        after = self.chat.end_of_turn_text()
        if after:
            ids = self.model.tokenize(after, add_special=False, parse_special=True)
            if ids and ids[0] in self.stop_ids:
                return int(ids[0])
        for candidate in (self.model.eot_id, self.model.eos_id):
            if candidate >= 0:
                return candidate
        raise ModelNotFoundError(f"{self.name}: the GGUF defines no EOS / end-of-turn token")
