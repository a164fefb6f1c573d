"""structlog configuration, called once by each entry point and never at import time.

JSON lines when stderr is not a terminal (systemd's journal, Slurm's output files), a
readable console format when it is.

Imported first by the launcher's entry point (`tidal.launcher.agent`) and by the worker
library (`tidal.train`): structlog is imported here with `rich` hidden (below)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

# structlog's console renderer imports rich (and pygments) when they are installed, for its
# tracebacks: about 0.1 CPU-second that every launcher start pays before it registers, and
# 0.15 s of every worker's start after torch's (a joiner's, on a grow's critical path). Tidal
# does not use them (console tracebacks are then structlog's plain ones), so rich is hidden
# while structlog is imported, unless the process imported either already (a training
# script that imports rich or structlog before tidal.train keeps rich's tracebacks). rich
# stays importable afterwards.
_HIDE_RICH = "rich" not in sys.modules and "structlog" not in sys.modules
if _HIDE_RICH:
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` raises ImportError
try:
    import structlog
finally:
    if _HIDE_RICH:
        del sys.modules["rich"]


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
