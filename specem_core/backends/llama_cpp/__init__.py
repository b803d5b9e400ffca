"""llama.cpp members in process (GGUF as shipped), through llama-cpp-python's low-level API.

One package, a module per concern: :mod:`._binding` (the ctypes library, a context, a batch of
work), :mod:`._shared` (one context shared by every session: continuous batching), :mod:`._invariant`
(the kernel paths that keep a row's logits independent of its call), :mod:`.model`
(weights and the pool of contexts with the prefix cache; its vocabulary helpers in
:mod:`._vocab`), :mod:`.member` (the member: chat format, tokenizer helpers), :mod:`.session` (one
request's KV state) and :mod:`._threads` (threads per decode that follow the cores other processes
leave free). What the llama.cpp and transformers backends share lives in
:mod:`specem_core.backends._local`.

Concurrency: one :class:`LlamaCppModel` holds the weights once (memory-mapped) and a pool of
contexts; each open session takes one, so concurrent requests run at the same time without ever
seeing each other's KV rows. The pool has ``max_contexts`` entries (more requests wait for one).
With ``continuous_batching`` the sessions instead take slots of one shared context and share its
``llama_decode`` calls (:mod:`._shared`).
"""

from specem_core.backends.llama_cpp._binding import LlamaCppError, default_threads, requantize
from specem_core.backends.llama_cpp._shared import MAX_SLOTS, SharedStats
from specem_core.backends.llama_cpp.member import LlamaCppMember
from specem_core.backends.llama_cpp.model import LlamaCppModel
from specem_core.backends.llama_cpp.session import LlamaCppSession

__all__ = [
    "MAX_SLOTS",
    "LlamaCppError",
    "LlamaCppMember",
    "LlamaCppModel",
    "LlamaCppSession",
    "SharedStats",
    "default_threads",
    "requantize",
]
