"""Structured logging: one JSON object per line, `call_id` bound on every call-scoped event.

Call `configure_logging()` once at process start (the CLI does); modules take a logger with
`structlog.get_logger(__name__)` and bind `call_id` with `log.bind(call_id=...)`.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", json: bool = True) -> None:
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
