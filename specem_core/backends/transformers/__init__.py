"""Local transformers members (CPU or GPU), with one reused KV cache per request.

One package, a module per concern: :mod:`.member` (loading, chat format, tokenizer helpers),
:mod:`.session` (one request's KV state and the prefix cache), :mod:`.batched` (the forward
passes concurrent sessions share). What the transformers and llama.cpp backends share lives in
:mod:`specem_core.backends._local`.
"""

from specem_core.backends.transformers.member import TransformersMember
from specem_core.backends.transformers.session import TransformersSession

__all__ = ["TransformersMember", "TransformersSession"]
