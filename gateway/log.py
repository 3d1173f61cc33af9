"""Structured logging: one JSON object per line, `call_id` bound on every call-scoped event.

Call `configure_logging()` once at process start (the CLI does); modules take a logger with
`structlog.get_logger(__name__)` and bind `call_id` with `log.bind(call_id=...)`.

Logs go to stderr (journald) or, with `logging.file`, appended to that file. `reopen_logs()` (SIGHUP)
closes and reopens the file at its configured path, so logrotate can move it away and the gateway
writes on into a fresh one; the level can change at the same time.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


class _LogSink:
    """The stream every log line is written to: stderr, or a file that can be reopened in place."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._stream: TextIO = sys.stderr

    def open(self, path: str | None) -> None:
        old = self._stream
        # line-buffered: a crash loses no finished line, and `tail -f` sees each event at once
        self._stream = open(path, "a", encoding="utf-8", buffering=1) if path else sys.stderr  # noqa: SIM115
        self.path = path
        if old is not sys.stderr and old is not self._stream:
            old.close()

    def write(self, text: str) -> int:
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()


_sink = _LogSink()


def configure_logging(level: str = "info", json: bool = True, file: str | None = None) -> None:
    """Set up structlog and the stdlib root logger; raises OSError if `file` cannot be opened."""
    _sink.open(file)
    logging.basicConfig(format="%(message)s", stream=_sink, level=level.upper(), force=True)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per line (message + newline): print() writes them separately, and where the gateway and
        # its workers share one stream unbuffered (PYTHONUNBUFFERED, a journald socket) another process's
        # line could land between them (CI saw two events on one line of a supervised serve's log).
        logger_factory=structlog.WriteLoggerFactory(file=_sink),
        cache_logger_on_first_use=False,
    )


def reopen_logs(level: str, file: str | None) -> None:
    """SIGHUP: reopen the log file (after logrotate moved it) and apply the level; raises OSError if the
    new file cannot be opened, leaving the old stream in place."""
    _sink.open(file)
    logging.getLogger().setLevel(level.upper())
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())))
