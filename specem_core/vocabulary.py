"""One name per concept on every surface, and a loud error for a name that means nothing.

The engine's fields are :class:`~specem_core.config.SpecEMConfig`'s. The surfaces on top follow
their host's conventions where it has one (OpenAI, LangChain and LlamaIndex all say
``max_tokens``), so each field may have one other spelling here; everything else that is not a
field is rejected with the closest names, never dropped.

==================  =============================  =========================================
concept             SpecEMConfig / SpecEM          CLI / LangChain / LlamaIndex / server
==================  =============================  =========================================
answer cap          ``max_new_tokens``             ``--max-tokens`` / ``max_tokens`` (the
                                                   server also ``max_completion_tokens``)
stop strings        ``stop``                       ``--stop`` / ``stop`` (``stop_sequences``)
member retries      ``member_retries``             ``max_retries``
==================  =============================  =========================================

:data:`ALIASES` is the one table of these spellings (any accepted spelling -> the field), and
:data:`SURFACE_NAMES` the one table the other way (the field -> the surfaces' name): every surface
reads them (through :func:`config_fields` and ``specem_integrations._options``) instead of
spelling the pairs itself.

Example:
    >>> config_fields({"max_tokens": 64, "temperature": 0}, where="ChatSpecEM")
    {'max_new_tokens': 64, 'temperature': 0}
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from specem_core.config import OPTIONS, RENAMED, current_names
from specem_core.errors import ConfigError

CONFIG_FIELDS = frozenset(OPTIONS)
"""Every :class:`~specem_core.config.SpecEMConfig` field name."""

ALIASES: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "stop_sequences": "stop",
    "max_retries": "member_retries",
}
"""Surface name -> the SpecEMConfig field it sets."""

SURFACE_NAMES: dict[str, str] = {"max_new_tokens": "max_tokens", "member_retries": "max_retries"}
"""The field -> the name the surfaces give it (a class field, a ``--flag``, a request parameter),
for the fields the hosts name otherwise (OpenAI, LangChain and LlamaIndex say ``max_tokens``); the
other fields keep their own names there. The one table in this direction: :data:`ALIASES` reads
the other way (any accepted spelling -> the field)."""

OPENAI_ALIASES: dict[str, str] = {"max_completion_tokens": "max_new_tokens"}
"""Spellings the OpenAI-compatible server takes besides :data:`ALIASES` (OpenAI's newer name of
``max_tokens``; given both, it wins)."""


def surface_names(attributes: Iterable[str]) -> dict[str, str]:
    """Deprecated (until 0.3): read :data:`SURFACE_NAMES`. Field -> the surface's own name for it,
    for the :data:`ALIASES` a surface holds as attributes.

    Example:
        >>> import warnings; warnings.simplefilter("ignore", FutureWarning)
        >>> surface_names(["max_tokens", "max_retries", "temperature"])
        {'max_new_tokens': 'max_tokens', 'member_retries': 'max_retries'}
    """
    warnings.warn(
        "specem_core.vocabulary.surface_names is deprecated: read SURFACE_NAMES; it goes in 0.3",
        FutureWarning,
        stacklevel=2,
    )
    names = set(attributes)
    return {field: alias for alias, field in ALIASES.items() if alias in names}


def config_fields(options: Mapping[str, Any], *, where: str, extra: Iterable[str] = ()) -> dict[str, Any]:
    """``options`` with aliases turned into :class:`SpecEMConfig` field names (``None`` values
    dropped: "not given"); names of 0.1 (:data:`specem_core.config.RENAMED`) are accepted with a
    ``FutureWarning``.

    Args:
        options: names as a surface received them.
        where: the surface, for the message (``"ChatSpecEM"``, ``"the 'specem' request object"``).
        extra: other names the surface itself accepts, offered in the message's suggestions.

    Raises:
        ConfigError: a name that is neither a field nor an alias (with the closest known names),
            or a field given twice under two spellings.
    """
    out: dict[str, Any] = {}
    for key, value in current_names(options, where=where).items():
        field = ALIASES.get(key, key)
        if field not in CONFIG_FIELDS:
            raise unknown_option(key, where=where, known=[*CONFIG_FIELDS, *ALIASES, *RENAMED, *extra])
        if value is None:
            continue
        if field in out:
            raise ConfigError(f"{where}: {field} given twice (as {field} and as one of its aliases)")
        out[field] = tuple(value) if field == "stop" and isinstance(value, list) else value
    return out


def unknown_option(key: str, *, where: str, known: Iterable[str]) -> ConfigError:
    """The error for an option ``where`` does not know, naming the closest known ones."""
    close = difflib.get_close_matches(key, sorted(set(known)), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ConfigError(f"{where} got an unknown option {key!r}{hint}")


def with_field_names(values: Mapping[str, Any], aliases: Mapping[str, str], *, where: str) -> dict[str, Any]:
    """A constructor's keyword arguments with each alias renamed to the field it stands for.

    Raises:
        ConfigError: a field given under two spellings.
    """
    out = dict(values)
    for alias, name in aliases.items():
        if alias in out:
            if out.get(name) is not None:
                raise ConfigError(f"{where}: {name} given twice (as {name} and as {alias})")
            out[name] = out.pop(alias)
    return out


def check_known(keys: Iterable[str], known: Iterable[str], *, where: str) -> None:
    """Every key is a known argument of ``where``.

    Raises:
        ConfigError: the first unknown key, with the closest known names.
    """
    allowed = set(known)
    for key in keys:
        if key not in allowed:
            raise unknown_option(key, where=where, known=allowed)
