"""structlog setup: JSON lines when stderr is not a TTY (or --log-format json), pretty otherwise."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_level = logging.DEBUG
"""The level `configure_logging` set (structlog's default, before it: every line is written)."""


def debug_enabled() -> bool:
    """Whether debug lines are written: a per-call debug line whose arguments cost something to make (the
    interceptor's one per RPC) is skipped at once when they are not."""
    return _level <= logging.DEBUG


def configure_logging(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Log lines at `level` and above to `stream` (stderr)."""
    global _level
    _level = _LEVELS[level]
    stream = sys.stderr if stream is None else stream
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
