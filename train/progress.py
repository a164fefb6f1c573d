"""Worker-side progress reports: a training script may call `report_progress(step)` after
each step; its launcher passes the last one to the controller with every heartbeat, and a
worker silent past the job's progress timeout counts as hung. Scripts that never call it
(unmodified torchrun scripts) are judged by heartbeats and exits only."""

from __future__ import annotations

import os
import time
from pathlib import Path


def report_progress(step: int) -> None:
    """Record that `step` completed now. A no-op outside a Tidal launcher."""
    target = os.environ.get("TIDAL_PROGRESS_FILE")
    if not target:
        return
    path = Path(target)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(f"{step} {time.time():.6f}\n")
    os.replace(temporary, path)
