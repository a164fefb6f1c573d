"""bench.overhead: a torchft run with no steady rate is run again once, and says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import overhead
from bench.overhead import Run


def test_a_torchft_run_without_a_rate_is_run_again_once_in_its_own_folder(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    folders: list[Path] = []
    results = iter([Run(float("nan"), float("nan"), float("nan")), Run(30.0, 0.05, 0.001)])

    def attempt(folder: Path, settings: Any, lighthouse: Path) -> Run:
        folders.append(folder)
        return next(results)

    monkeypatch.setattr(overhead, "torchft_attempt", attempt)
    run = overhead.torchft_run(tmp_path / "cpu-0-torchft", None, tmp_path / "lighthouse")  # type: ignore[arg-type]
    assert run.steps_per_s == 30.0 and run.attempts == 2
    assert folders == [tmp_path / "cpu-0-torchft", tmp_path / "cpu-0-torchft" / "again"]


def test_a_torchft_run_with_a_rate_is_run_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(overhead, "torchft_attempt", lambda folder, settings, lighthouse: calls.append(folder)
                        or Run(25.0, 0.05, 0.001))
    assert overhead.torchft_run(tmp_path, None, tmp_path).attempts == 1  # type: ignore[arg-type]
    assert calls == [tmp_path]
