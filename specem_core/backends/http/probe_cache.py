"""What a probe found, kept per server: in this process and on disk, so that a new process's first
request asks its servers nothing it asked before.

An entry is keyed by what decides the answer (:class:`ProbeKey`): the server's URL, the served model
id, the server software and its version (vLLM's ``/version``, llama.cpp's ``/props``,
llama-cpp-python's ``/openapi.json``; :data:`VERSION_ENDPOINTS`), and the member's own side of the
questions (its prompt format and modes: :func:`member_fingerprint`). A server restarted with other
flags under the same version (vLLM without ``--enable-scale-out``) keeps its key: a member whose
cached scoring path is refused forgets the entry and probes again
(:meth:`OpenAIHTTPMember.reprobe_scoring <specem_core.backends.http.member.OpenAIHTTPMember.reprobe_scoring>`).

The files live in ``$SPECEM_PROBE_CACHE_DIR``, else ``$SPECEM_HOME/probes`` (else
``$XDG_CACHE_HOME/specem/probes``, else ``~/.cache/specem/probes``), one JSON file per key;
``SPECEM_PROBE_CACHE=0`` (or a member's ``probe_cache=False``) keeps them in memory only,
``specem_core.backends.http.probe_cache.clear()`` empties both. A file that cannot be read or
written is ignored (logged): the cache only saves requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specem_core.backends.http.probe import ServerCapabilities
from specem_core.config import cache_dir

log = logging.getLogger("specem.http")

SCHEMA = 1
"""The entry format; an entry of another format is ignored (and replaced)."""

VERSION_ENDPOINTS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("/version", ("version",)),
    "sglang": ("/get_server_info", ("version",)),
    "llama.cpp": ("/props", ("build_info",)),
    "llama-cpp-python": ("/openapi.json", ("info", "version")),
}
"""Server software -> (path beside ``/v1``, the keys to its version in the answer)."""


@dataclass(frozen=True)
class ProbeKey:
    """What decides a probe's answer."""

    base_url: str
    model: str | None
    server: str
    version: str | None
    """The server software's version (``None`` where it does not say)."""
    member: str
    """:func:`member_fingerprint` of the member that asks."""

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def member_fingerprint(**fields: Any) -> str:
    """A digest of the member's side of the probe (its probe prompt, modes, extra request fields)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def version_of(kind: str, body: Any) -> str | None:
    """The version in the answer of ``kind``'s version endpoint, if it says one."""
    spec = VERSION_ENDPOINTS.get(kind)
    if spec is None:
        return None
    value = body
    for key in spec[1]:
        value = value.get(key) if isinstance(value, dict) else None
    return str(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else None


def disk_enabled() -> bool:
    """Whether entries are written to disk (``SPECEM_PROBE_CACHE`` is not ``0``/``false``/``off``)."""
    return os.environ.get("SPECEM_PROBE_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def directory() -> Path:
    """Where the entries are written: ``$SPECEM_PROBE_CACHE_DIR``, else ``probes`` in SpecEM's cache."""
    chosen = os.environ.get("SPECEM_PROBE_CACHE_DIR")
    return Path(chosen).expanduser() if chosen else cache_dir() / "probes"


_memory: dict[str, ServerCapabilities] = {}
_lock = threading.Lock()


def load(key: ProbeKey, *, disk: bool = True) -> ServerCapabilities | None:
    """The capabilities found for ``key`` before (this process first, then disk), or ``None``."""
    digest = key.digest()
    with _lock:
        found = _memory.get(digest)
    if found is not None or not (disk and disk_enabled()):
        return found
    path = directory() / f"{digest}.json"
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.info("probe cache: %s unreadable (%s); probing again", path, exc)
        return None
    caps = _from_entry(entry, key)
    if caps is not None:
        with _lock:
            _memory[digest] = caps
    return caps


def store(key: ProbeKey, caps: ServerCapabilities, *, disk: bool = True) -> None:
    """Keep ``caps`` for ``key`` (in this process, and on disk unless turned off)."""
    digest = key.digest()
    with _lock:
        _memory[digest] = caps
    if not (disk and disk_enabled()):
        return
    entry = {"schema": SCHEMA, "key": dataclasses.asdict(key), "capabilities": dataclasses.asdict(caps)}
    folder = directory()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".probe-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, folder / f"{digest}.json")  # readers never see half a file
    except OSError as exc:
        log.info("probe cache: could not write %s (%s)", folder, exc)


def forget(key: ProbeKey) -> None:
    """Drop ``key``'s entry (both places)."""
    digest = key.digest()
    with _lock:
        _memory.pop(digest, None)
    try:
        (directory() / f"{digest}.json").unlink(missing_ok=True)
    except OSError as exc:
        log.info("probe cache: could not remove the entry %s (%s)", digest, exc)


def clear(*, disk: bool = True) -> None:
    """Forget every entry (this process's; and the files, unless ``disk=False``)."""
    with _lock:
        _memory.clear()
    if disk and directory().is_dir():
        for path in directory().glob("*.json"):
            path.unlink(missing_ok=True)


def _from_entry(entry: Any, key: ProbeKey) -> ServerCapabilities | None:
    if not isinstance(entry, dict) or entry.get("schema") != SCHEMA or entry.get("key") != dataclasses.asdict(key):
        return None
    fields = entry.get("capabilities")
    if not isinstance(fields, dict):
        return None
    known = {f.name: f for f in dataclasses.fields(ServerCapabilities)}
    if set(fields) != set(known):
        return None
    values: dict[str, Any] = {name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()}
    try:
        return ServerCapabilities(**values)
    except TypeError:
        return None
