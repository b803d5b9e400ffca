"""Member specs -> loaded members: the one module that knows every backend.

A spec is a packaged default model name (``"smollm2"``), a local directory, a ``.gguf`` file, a
Hugging Face model id, an OpenAI-compatible server (``openai:http://host:8000/v1#model``,
``judge:https://…/v1#model``), or any of the first two for llama.cpp (``llamacpp:smollm2``,
``llamacpp:/models/x.gguf``). :func:`_resolve` decides which backend a spec goes to;
:func:`load_member` builds the member, resolving what a backend cannot know by itself (packaged
names of weights and tokenizers) and handing it in. Backends never import this module or
:mod:`specem_core.models`.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specem_core.errors import ConfigError, ModelNotFoundError
from specem_core.gguf import read_token_texts, validate_gguf
from specem_core.models import (
    DEFAULT_MODELS,
    PackagedModel,
    convert,
    converted_path,
    find_packaged,
    is_converted,
    local_gguf,
    log_stderr,
    packaged_gguf,
)

if TYPE_CHECKING:
    from specem_core.backends.base import Member

BackendName = Literal["transformers", "llamacpp", "http"]
"""Which backend a spec selects."""
LOCAL_BACKENDS = ("auto", "transformers", "llamacpp")
"""What ``backend=`` accepts for local weights (``auto``: see :func:`default_backend`)."""

HTTP_PREFIXES = ("openai:", "judge:")
"""Spec prefixes of server members (:mod:`specem_core.backends.http`)."""
LLAMACPP_PREFIX = "llamacpp:"

_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str, str], tuple[Any, Any]] = {}
"""Shared weights: ``(source, device, dtype) -> (model, tokenizer)``."""
_LOADED_GGUF: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
"""Shared llama.cpp models: ``(path, options) -> LlamaCppModel``."""


def default_backend() -> Literal["transformers", "llamacpp"]:
    """The backend of local members when none is named: llama.cpp when llama-cpp-python imports and
    no CUDA device is visible (it is the faster of the two on a CPU: docs/reports/performance.md),
    else transformers."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "transformers"
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return "transformers"
    return "llamacpp"


def _check_backend(backend: str | None) -> str:
    value = (backend or "auto").strip().lower()
    if value not in LOCAL_BACKENDS:
        raise ModelNotFoundError(f"unknown backend {backend!r}: use one of {', '.join(LOCAL_BACKENDS)}")
    return value


@dataclass(frozen=True)
class _Resolved:
    """Where a spec points: the backend, what it loads from, and the packaged model if any."""

    backend: BackendName
    source: str
    """The server spec, or a local path / ``.gguf`` file / HF id (a packaged model's name)."""
    packaged: PackagedModel | None = None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or (os.sep in spec and Path(spec).expanduser().exists())


def _resolve(spec: str, backend: str = "auto") -> _Resolved:
    """The backend and source of a (stripped, non-empty) spec; nothing is loaded or converted.

    ``llamacpp:`` in front of a spec, or ``backend="llamacpp"``, selects llama.cpp; ``"auto"``
    selects :func:`default_backend` for packaged names and ``.gguf`` files, transformers for
    directories and HF ids (llama.cpp loads GGUF files only).

    Raises:
        ModelNotFoundError: a missing path, a bare name that is no packaged model, or llama.cpp
            asked to load something that is not a GGUF file.
    """
    if spec.startswith(HTTP_PREFIXES):
        return _Resolved("http", spec)
    if spec.startswith(LLAMACPP_PREFIX):
        spec, backend = spec[len(LLAMACPP_PREFIX) :].strip(), "llamacpp"
        if not spec:
            raise ModelNotFoundError("empty model name after 'llamacpp:'")
    packaged = find_packaged(spec)
    gguf = packaged is not None or spec.endswith(".gguf")
    chosen: BackendName
    if backend == "auto" and packaged is not None and not packaged.convertible:
        chosen = "llamacpp"  # no fp32 copy for transformers is made of it (e.g. the 1.5B: 7 GB)
    elif backend == "auto":
        chosen = default_backend() if gguf else "transformers"
    else:
        chosen = "llamacpp" if backend == "llamacpp" else "transformers"
    if packaged is not None:
        return _Resolved(chosen, packaged.name, packaged)
    if _looks_like_path(spec) or spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"no such model file or directory: {spec}")
        if chosen == "llamacpp" and not path.is_file():
            raise ModelNotFoundError(f"llama.cpp loads a .gguf file, not a directory: {spec}")
        return _Resolved(chosen, str(path))
    if "/" not in spec:
        known = ", ".join(m.name for m in DEFAULT_MODELS)
        raise ModelNotFoundError(
            f"unknown model {spec!r}: use one of {known}, a local directory, a .gguf file, or an HF id (org/name)"
        )
    if chosen == "llamacpp":
        raise ModelNotFoundError(f"llama.cpp loads local .gguf files; {spec!r} looks like a hub id")
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


def served_model_template(model: str) -> Any:
    """The chat template (and tokenizer, when there is one) of a served model id that names
    something on this machine, or ``None``: how a server member drafts exactly without
    ``tokenizer=`` (:class:`~specem_core.backends.http.member.OpenAIHTTPMember` calls it with the
    served model id after probing).

    * a packaged model's name (``qwen2.5-coder-1.5b-instruct``, any alias, or its GGUF file name):
      its converted tokenizer directory when converted, else the template its GGUF carries (no
      conversion; nothing is installed or assembled here);
    * a local ``.gguf`` file (llama.cpp's servers list the model's path): the template it carries;
    * a local tokenizer directory, or a Hugging Face id in the local cache: that tokenizer.
    """
    text = model.strip()
    if not text:
        return None
    packaged = find_packaged(text) or find_packaged(Path(text).name.removesuffix(".gguf"))
    if packaged is not None:
        if is_converted(packaged):
            return str(converted_path(packaged))
        path = local_gguf(packaged)
        return _gguf_template(path) if path is not None else None
    local = Path(text).expanduser()
    if text.endswith(".gguf") and local.is_file():
        return _gguf_template(local)
    if local.is_dir() and (local / "tokenizer_config.json").is_file():
        return str(local)
    if "/" in text and not text.startswith(("/", ".", "~")) and importlib.util.find_spec("transformers") is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(text, local_files_only=True)
        except (OSError, ValueError):
            return None
    return None


def _gguf_template(path: Path) -> Any:
    """A GGUF file's chat template with the special tokens it writes, as a tokenizer stand-in
    (:class:`~specem_core.backends.http.tokenizer.TemplateOnly`); ``None`` without a template."""
    from specem_core.backends.http.tokenizer import TemplateOnly
    from specem_core.chat_format import ChatFormat

    try:
        info = validate_gguf(path)
    except ModelNotFoundError:
        return None
    if not info.chat_template:
        return None
    keys = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eos_token_id")
    bos, eot, eos = (info.metadata.get(k) for k in keys)
    ids = [i for i in (bos, eot, eos) if isinstance(i, int) and not isinstance(i, bool)]
    texts = read_token_texts(path, ids)
    bos_text, eos_text = texts.get(bos, "") if bos is not None else "", texts.get(eos, "") if eos is not None else ""
    after = ChatFormat(TemplateOnly(info.chat_template, bos_text, eos_text)).end_of_turn_text() or ""
    ends = [(i, texts[i]) for i in (eot, eos) if i is not None and i in texts and texts[i]]
    end_of_turn = next((t for _, t in ends if after.startswith(t)), None)
    return TemplateOnly(
        info.chat_template, bos_text, eos_text, end_of_turn=end_of_turn, stop_ids=tuple(sorted({i for i, _ in ends}))
    )


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
    backend: str | None = None,
    **kwargs: Any,
) -> Member:
    """A member from a default model name, a local directory, a ``.gguf`` file, an HF id, or an
    OpenAI-compatible server (``openai:http://host:8000/v1#model``, ``judge:https://…/v1#model``).

    Loaded weights are shared: asking twice for the same model returns members over the same
    model object (members are read-only and thread-safe).

    Args:
        backend: ``"auto"`` (default: :func:`default_backend` for packaged names and ``.gguf``
            files), ``"transformers"`` or ``"llamacpp"``; a ``llamacpp:`` spec prefix wins.
        api_key_env: for server specs, the environment variable holding the API key (the key
            itself never appears in a spec).
        **kwargs: backend options: transformers' ``from_pretrained`` arguments (and the member's
            ``chat_template`` and ``request_batch_size``), or llama.cpp's ``n_ctx``, ``n_threads``,
            ``max_contexts``, ``n_gpu_layers``, ``flash_attention``, ``history_invariant``,
            ``continuous_batching``, ``chat_template``.

    Raises:
        ModelNotFoundError: unknown name or backend, missing path, or weights that cannot be loaded.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError("empty model name")
    spec = spec.strip()
    resolved = _resolve(spec, _check_backend(backend))
    if resolved.backend == "http":
        return _load_http(
            resolved, name=name, can_draft=can_draft, can_verify=can_verify, api_key_env=api_key_env, **kwargs
        )
    if resolved.backend == "llamacpp":
        return _load_llama_cpp(
            resolved, name=name, can_draft=can_draft, can_verify=can_verify, log=log or log_stderr, **kwargs
        )
    return _load_transformers(
        resolved,
        spec,
        name=name,
        can_draft=can_draft,
        can_verify=can_verify,
        device=device,
        dtype=dtype,
        log=log or log_stderr,
        **kwargs,
    )


_LOCAL_ONLY = {
    "n_ctx",
    "flash_attention",
    "prefix_cache",
    "prefix_cache_tokens",
    "history_invariant",
    "continuous_batching",
}
"""Options of local members that a server member refuses (its server decides them)."""


def _load_http(
    resolved: _Resolved,
    *,
    name: str | None,
    can_draft: bool | None,
    can_verify: bool,
    api_key_env: str | None,
    **kwargs: Any,
) -> Member:
    from specem_core.backends.http.factory import member_from_spec

    local = sorted(set(kwargs) & _LOCAL_ONLY)
    if local:
        raise ConfigError(
            f"{', '.join(local)} set for server member {resolved.source!r}: these are options of local members; "
            "a server keeps its own window and prefix cache (vLLM: --max-model-len, --enable-prefix-caching)"
        )
    options: dict[str, Any] = dict(kwargs)
    if "tokenizer" in options:
        options["tokenizer"] = resolve_tokenizer(options["tokenizer"])
    elif "chat_template" not in options and resolved.source.startswith("openai:"):
        options.setdefault("template_resolver", served_model_template)
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
    if "n_ctx" in kwargs:
        raise ConfigError(
            f"n_ctx set for transformers member {spec!r}: it is an option of llama.cpp members; a transformers "
            "member reads up to its model's max_position_embeddings"
        )
    if kwargs.pop("history_invariant", False):
        raise ConfigError(
            f"history_invariant set for transformers member {spec!r}: it is an option of llama.cpp members; a "
            "transformers member batches concurrent requests' decode steps, which moves the last bits of a logit"
        )
    if kwargs.pop("continuous_batching", False):
        raise ConfigError(
            f"continuous_batching set for transformers member {spec!r}: it is an option of llama.cpp members; a "
            "transformers member always batches concurrent requests' decode steps"
        )
    if "flash_attention" in kwargs:
        raise ConfigError(
            f"flash_attention set for transformers member {spec!r}: it is an option of llama.cpp members; "
            'a transformers member takes attn_implementation (e.g. "sdpa", "flash_attention_2")'
        )
    options: dict[str, Any] = {"chat_template": kwargs.pop("chat_template", None)}
    for option in ("request_batch_size", "prefix_cache", "prefix_cache_tokens"):  # the member's, not the weights'
        if option in kwargs:
            options[option] = kwargs.pop(option)
    key = (source, str(device), str(dtype))
    with _LOCK:
        loaded = _LOADED.get(key)
    if loaded is None:
        member = TransformersMember.from_pretrained(source, device=device, dtype=dtype, **kwargs)
        with _LOCK:
            _LOADED.setdefault(key, (member.model, member.tokenizer))
            loaded = _LOADED[key]
    model, tokenizer = loaded
    return TransformersMember(
        model, tokenizer, name=name or default_name, can_draft=draft, can_verify=can_verify, **options
    )


def _load_llama_cpp(
    resolved: _Resolved,
    *,
    name: str | None,
    can_draft: bool | None,
    can_verify: bool,
    log: Callable[[str], None],
    chat_template: str | None = None,
    device: str | None = None,
    dtype: Any = None,
    **model_kwargs: Any,
) -> Member:
    from specem_core.backends.llama_cpp import LlamaCppMember, LlamaCppModel

    del dtype  # GGUF weights run as shipped (quantized)
    if device not in (None, "cpu") and "n_gpu_layers" not in model_kwargs:
        model_kwargs["n_gpu_layers"] = -1  # all layers on the GPU build's device
    packaged = resolved.packaged
    if packaged is not None:
        path = packaged_gguf(packaged, log=log)
        default_name = packaged.name
        draft = packaged.can_draft if can_draft is None else can_draft
    else:
        path = Path(resolved.source)
        default_name = path.name.removesuffix(".gguf")
        draft = True if can_draft is None else can_draft
    key = (str(path.resolve()), tuple(sorted(model_kwargs.items())))
    with _LOCK:
        model = _LOADED_GGUF.get(key)
    if model is None:
        loaded = LlamaCppModel(path, **model_kwargs)
        with _LOCK:
            model = _LOADED_GGUF.setdefault(key, loaded)
        if model is not loaded:
            loaded.close()
    return LlamaCppMember(
        model, name=name or default_name, can_draft=draft, can_verify=can_verify, chat_template=chat_template
    )
