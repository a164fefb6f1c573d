"""The optional ledger: one JSONL file per process recording every step attempt (with its
sample indices), commit, world formed, transfer, step abandoned and leave, for audits and
tests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class Ledger:
    """Optional JSONL record of every step attempt and commit (for audits and tests)."""

    def __init__(self, directory: Path | None) -> None:
        self._file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._file = open(directory / f"ledger-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "pid": os.getpid(), "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
