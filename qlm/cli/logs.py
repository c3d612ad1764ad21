"""How QLM's service processes log (``qlm api``, ``controller``, ``serve``, ``sim-engine serve``):
at ``QLM_LOG_LEVEL``, on standard error, as text or, with ``QLM_LOG_FORMAT=json``, as one JSON
object per line.

Every line goes through the root logger's one handler, the HTTP server's (uvicorn's) too: the
servers are started without a logging configuration of their own (``log_config=None``), so that
a JSON log holds no line in another format. Python's warnings are logged as well
(``py.warnings``) rather than printed.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from qlm.cli.common import guard

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

QUIET_LOGGERS = ("httpx", "httpcore")
"""Libraries that log every HTTP call at INFO (each stream to vLLM, each health check): shown
only at QLM_LOG_LEVEL=DEBUG."""

_RECORD_FIELDS = frozenset(
    [*logging.LogRecord("", 0, "", 0, "", (), None).__dict__, "message", "asctime", "taskName"]
)
_DROPPED = frozenset({"color_message"})  # uvicorn's copy of its message with terminal colours


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: ``time`` (ISO 8601, UTC, milliseconds), ``level``,
    ``logger``, ``message``, then the fields the call gave (``extra=``), and the exception or
    the stack as text when there is one. Newlines inside are escaped: one record, one line."""

    def format(self, record: logging.LogRecord) -> str:
        at = datetime.fromtimestamp(record.created, tz=UTC)
        doc: dict[str, Any] = {
            "time": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and key not in _DROPPED and not key.startswith("_"):
                doc.setdefault(key, value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def logs_json() -> bool:
    """Whether the root logger writes JSON (``setup_logging`` was asked for it)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to standard error as it is when a line is written (a caller that replaced it, as a
    test runner does, may have closed the one there was when logging was set up)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def setup_logging(level: str, log_format: LogFormat, stream: TextIO | None = None) -> None:
    """Log at ``level`` in ``log_format`` to ``stream`` (standard error): the root logger gets
    one handler, replacing any it had; the HTTP clients' per-call lines only at DEBUG."""
    number = logging.getLevelNamesMapping()[level]
    handler = _Stderr() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=number, handlers=[handler], force=True)
    for existing in logging.Logger.manager.loggerDict.values():  # (a dictConfig disables them)
        if isinstance(existing, logging.Logger):
            existing.disabled = False
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # an earlier server's own setup
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)  # (a server started with log_level= had set its own)
    logging.captureWarnings(True)
    if number > logging.DEBUG:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(max(number, logging.WARNING))


def configure_logging() -> None:
    """Log as ``QLM_LOG_LEVEL`` and ``QLM_LOG_FORMAT`` say; a bad value of either stops the
    command with one line naming it."""
    from qlm.settings import get_settings

    settings = guard(get_settings)
    setup_logging(settings.log_level, settings.log_format)
