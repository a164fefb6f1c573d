"""Fixtures the Slurm tier's tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.slurm.test_live_multinode import OneProcessRun


@pytest.fixture
def one_process_run(tmp_path: Path) -> Iterator[Callable[[int], OneProcessRun]]:
    """Makes the test's OneProcessRun of so many steps; stops it if the test ends first."""
    runs: list[OneProcessRun] = []

    def make(steps: int) -> OneProcessRun:
        runs.append(OneProcessRun(tmp_path, steps))
        return runs[-1]

    yield make
    for run in runs:
        run.stop()
