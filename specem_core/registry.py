"""Member specs -> loaded members: the one module that knows every backend.

A spec is a packaged default model name (``"smollm2"``), a local directory, a ``.gguf`` file, a
Hugging Face model id, or an OpenAI-compatible server (``openai:http://host:8000/v1#model``,
``judge:https://…/v1#model``). :func:`_resolve` decides which backend a spec goes to;
:func:`load_member` builds the member, resolving what a backend cannot know by itself (packaged
names of weights and tokenizers) and handing it in. Backends never import this module or
:mod:`specem_core.models`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specem_core.errors import ModelNotFoundError
from specem_core.models import (
    DEFAULT_MODELS,
    DEFAULT_PAIR,
    PackagedModel,
    _log_stderr,
    convert,
    converted_path,
    find_packaged,
    is_converted,
)

if TYPE_CHECKING:
    from specem_core.backends.base import Member
    from specem_core.engine import SpecEM

BackendName = Literal["transformers", "http"]
"""Which backend a spec selects (``llamacpp`` will be one more)."""

HTTP_PREFIXES = ("openai:", "judge:")
"""Spec prefixes of server members (:mod:`specem_core.backends.http`)."""

_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str, str], tuple[Any, Any]] = {}
"""Shared weights: ``(source, device, dtype) -> (model, tokenizer)``."""


@dataclass(frozen=True)
class _Resolved:
    """Where a spec points: the backend, what it loads from, and the packaged model if any."""

    backend: BackendName
    source: str
    """The server spec, or a local path / ``.gguf`` file / HF id (a packaged model's name)."""
    packaged: PackagedModel | None = None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or (os.sep in spec and Path(spec).expanduser().exists())


def _resolve(spec: str) -> _Resolved:
    """The backend and source of a (stripped, non-empty) spec; nothing is loaded or converted.

    Raises:
        ModelNotFoundError: a missing path, or a bare name that is no packaged model.
    """
    if spec.startswith(HTTP_PREFIXES):
        return _Resolved("http", spec)
    packaged = find_packaged(spec)
    if packaged is not None:
        return _Resolved("transformers", packaged.name, packaged)
    if _looks_like_path(spec) or spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"no such model file or directory: {spec}")
        return _Resolved("transformers", str(path))
    if "/" not in spec:
        known = ", ".join(m.name for m in DEFAULT_MODELS)
        raise ModelNotFoundError(
            f"unknown model {spec!r}: use one of {known}, a local directory, a .gguf file, or an HF id (org/name)"
        )
    return _Resolved("transformers", spec)


def resolve_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` with a packaged model's name (``"smollm2"``) replaced by the directory of its
    converted cache, which holds the tokenizer; anything else (a path, an HF id, an object) as is.

    Raises:
        ModelNotFoundError: the packaged model is not converted yet.
    """
    if not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    packaged = find_packaged(str(tokenizer))
    if packaged is None:
        return tokenizer
    if not is_converted(packaged):
        raise ModelNotFoundError(f"{packaged.name} is not converted yet: run `specem models pull {packaged.name}`")
    return str(converted_path(packaged))


def load_member(
    spec: str,
    *,
    name: str | None = None,
    can_draft: bool | None = None,
    can_verify: bool = True,
    device: str | None = None,
    dtype: Any = "auto",
    log: Callable[[str], None] | None = None,
    api_key_env: str | None = None,
    **kwargs: Any,
) -> Member:
    """A member from a default model name, a local directory, a ``.gguf`` file, an HF id, or an
    OpenAI-compatible server (``openai:http://host:8000/v1#model``, ``judge:https://…/v1#model``).

    Loaded weights are shared: asking twice for the same model returns members over the same
    model object (members are read-only and thread-safe).

    Args:
        api_key_env: for server specs, the environment variable holding the API key (the key
            itself never appears in a spec).

    Raises:
        ModelNotFoundError: unknown name, missing path, or weights that cannot be loaded.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError("empty model name")
    spec = spec.strip()
    resolved = _resolve(spec)
    if resolved.backend == "http":
        return _load_http(
            resolved, name=name, can_draft=can_draft, can_verify=can_verify, api_key_env=api_key_env, **kwargs
        )
    return _load_transformers(
        resolved,
        spec,
        name=name,
        can_draft=can_draft,
        can_verify=can_verify,
        device=device,
        dtype=dtype,
        log=log or _log_stderr,
        **kwargs,
    )


def _load_http(
    resolved: _Resolved,
    *,
    name: str | None,
    can_draft: bool | None,
    can_verify: bool,
    api_key_env: str | None,
    **kwargs: Any,
) -> Member:
    from specem_core.backends.http.member import member_from_spec

    options: dict[str, Any] = dict(kwargs)
    if "tokenizer" in options:
        options["tokenizer"] = resolve_tokenizer(options["tokenizer"])
    if name is not None:
        options["name"] = name
    if can_draft is not None:
        options["can_draft"] = can_draft
    if not can_verify:
        options["can_verify"] = False
    return member_from_spec(resolved.source, api_key_env=api_key_env, **options)


def _load_transformers(
    resolved: _Resolved,
    spec: str,
    *,
    name: str | None,
    can_draft: bool | None,
    can_verify: bool,
    device: str | None,
    dtype: Any,
    log: Callable[[str], None],
    **kwargs: Any,
) -> Member:
    from specem_core.backends.transformers import TransformersMember

    packaged = resolved.packaged
    if packaged is not None:
        source = str(convert(packaged, log=log)) if not is_converted(packaged) else str(converted_path(packaged))
        default_name = packaged.name
        draft = packaged.can_draft if can_draft is None else can_draft
    else:
        source = resolved.source
        default_name = Path(spec).name.removesuffix(".gguf")
        draft = True if can_draft is None else can_draft
    key = (source, str(device), str(dtype))
    with _LOCK:
        loaded = _LOADED.get(key)
    if loaded is None:
        member = TransformersMember.from_pretrained(source, device=device, dtype=dtype, **kwargs)
        with _LOCK:
            _LOADED.setdefault(key, (member.model, member.tokenizer))
            loaded = _LOADED[key]
    model, tokenizer = loaded
    return TransformersMember(model, tokenizer, name=name or default_name, can_draft=draft, can_verify=can_verify)


def default_members(**kwargs: Any) -> list[Member]:
    """The default pair: SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct."""
    return [load_member(n, **kwargs) for n in DEFAULT_PAIR]


def default_engine(**config: Any) -> SpecEM:
    """A :class:`SpecEM` over :func:`default_members`; keyword arguments are config fields."""
    from specem_core.config import SpecEMConfig
    from specem_core.engine import SpecEM

    return SpecEM(default_members(), SpecEMConfig(**config))
