"""Logging of ``specem serve``: text (the default) or JSON lines (``--log-format json``), every
line with the request id of the request it was written for.

JSON: one object per line, ``{"time", "level", "logger", "message", "request_id", ...}``, plus the
fields the log call gave (``extra=``: a finished request's outcome, status, timings and tokens),
the access log's ``client``, ``method``, ``path`` and ``status``, and ``exception`` (the
traceback) when there is one. Text: ``LEVEL:    logger: message request_id=…``.
"""

from __future__ import annotations

import io
import json
import logging
import math
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from specem_integrations.server._request_ids import log_fields

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")


def _plain(value: Any) -> Any:
    """A JSON-safe value (non-finite floats as strings; anything unknown as its ``str``)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args
            entry.update(client=client, method=method, path=path, status=status)
        for key, value in log_fields(record).items():
            entry.setdefault(key, _plain(value))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """``LEVEL:    logger: message request_id=…`` (uvicorn's own lines without the logger name)."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)  # the message, and the traceback when there is one
        name = "" if record.name.startswith("uvicorn") else f"{record.name}: "
        request_id = getattr(record, "request_id", None)
        tag = f" request_id={request_id}" if request_id else ""
        first, newline, rest = message.partition("\n")
        return f"{record.levelname + ':':<10}{name}{first}{tag}{newline}{rest}"


def log_config(level: str = "info", log_format: LogFormat = "text") -> dict[str, Any]:
    """The ``logging.config.dictConfig`` of ``specem serve`` (given to uvicorn as ``log_config``).

    One handler on standard error for the ``specem`` loggers (at ``level``), uvicorn's and the
    access log, and the root logger at WARNING (other libraries' warnings in the same format),
    each line with the request id (:class:`~specem_integrations.server._request_ids.RequestIdFilter`).

    Raises:
        ValueError: an unknown format or level.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    upper = level.upper()
    if upper not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
        raise ValueError(f"unknown log level {level!r}")
    formatter = JsonFormatter if log_format == "json" else TextFormatter
    handler = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "formatter": "specem",
        "filters": ["request_id"],
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": "specem_integrations.server._request_ids.RequestIdFilter"}},
        "formatters": {"specem": {"()": f"{__name__}.{formatter.__name__}"}},
        "handlers": {"specem": handler},
        "loggers": {
            "specem": {"handlers": ["specem"], "level": upper, "propagate": False},
            "uvicorn": {"handlers": ["specem"], "level": upper, "propagate": False},
            "uvicorn.error": {"level": upper},
            "uvicorn.access": {"handlers": ["specem"], "level": upper, "propagate": False},
        },
        "root": {"handlers": ["specem"], "level": "WARNING"},
    }


class JsonLineWriter(io.TextIOBase):
    """A text stream whose lines are written to ``stream`` as JSON log lines (logger
    ``specem.serve``): ``specem serve``'s own messages (loading, listening) with ``--log-format
    json``, so that every line on standard error is one JSON object. A line starting with
    ``specem serve: warning`` is a WARNING, any other INFO."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self._pending = ""
        self._formatter = JsonFormatter()

    def write(self, text: str) -> int:
        self._pending += text
        while "\n" in self._pending:
            line, self._pending = self._pending.split("\n", 1)
            if line.strip():
                self._emit(line)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def _emit(self, line: str) -> None:
        level = logging.WARNING if line.startswith("specem serve: warning") else logging.INFO
        record = logging.LogRecord("specem.serve", level, __file__, 0, line, None, None)
        self._stream.write(self._formatter.format(record) + "\n")
