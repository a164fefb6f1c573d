"""structlog configuration, called once by each entry point and never at import time.

JSON lines when stderr is not a terminal (systemd's journal, Slurm's output files), a
readable console format when it is."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog


def configure_logging(*, level: str | None = None, json: bool | None = None,
                      stream: TextIO | None = None) -> None:
    """Configure structlog for a process. `json=None` decides by whether `stream` (stderr
    by default) is a terminal; $TIDAL_LOG_LEVEL and $TIDAL_LOG_FORMAT (json|console)
    override the defaults."""
    stream = stream or sys.stderr
    level_name = (level or os.environ.get("TIDAL_LOG_LEVEL") or "info").upper()
    numeric_level = logging.getLevelNamesMapping().get(level_name, logging.INFO)
    if json is None:
        requested = os.environ.get("TIDAL_LOG_FORMAT", "").lower()
        json = requested == "json" or (requested != "console" and not stream.isatty())
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
