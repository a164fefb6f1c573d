"""A failed worker's error file (TORCHELASTIC_ERROR_FILE), read back as torchrun reads it,
and what the controller makes of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_job_core import Driver, formed
from tidal.controller.cli import _event_line
from tidal.launcher.workers import (
    MAX_ERROR_MESSAGE_CHARS,
    MAX_TRACEBACK_CHARS,
    MAX_TRACEBACK_LINES,
    read_worker_error,
)
from tidal.proto import admin_pb2, common_pb2, launcher_pb2


def raise_deep(depth: int) -> None:
    if depth == 0:
        raise ValueError("boom 42")
    call_deeper(depth - 1)


def call_deeper(depth: int) -> None:
    # Two functions in turn: Python folds a frame repeated over and over into one line.
    raise_deep(depth)


def written_by_torch(path: Path, monkeypatch: pytest.MonkeyPatch, depth: int = 0) -> None:
    """What torch's own ErrorHandler (the one `@record` uses) writes for ValueError("boom 42")."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise_deep(depth)
    except ValueError as error:
        ErrorHandler().record_exception(error)


def test_no_error_file_is_no_error(tmp_path: Path) -> None:
    assert read_worker_error(tmp_path / "absent.json") is None


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", '{"message": 42}', '{"message": {"extraInfo": {}}}',
                                  '{"other": "x"}'])
def test_a_garbled_error_file_is_no_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(text)
    assert read_worker_error(path) is None


def test_the_file_torchs_error_handler_writes_gives_the_exception_and_its_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    written_by_torch(path, monkeypatch)
    error = read_worker_error(path)
    assert error is not None
    assert error.message == "ValueError: boom 42"
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert error.traceback.endswith("ValueError: boom 42") and "raise_deep" in error.traceback


def test_a_deep_traceback_keeps_its_last_lines_within_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    written_by_torch(path, monkeypatch, depth=60)
    error = read_worker_error(path)
    assert error is not None
    lines = error.traceback.splitlines()
    assert len(lines) == MAX_TRACEBACK_LINES and len(error.traceback) <= MAX_TRACEBACK_CHARS
    assert lines[-1] == "ValueError: boom 42"


def test_the_plain_message_format_and_a_long_message(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "RuntimeError: " + "x" * 5000, "timestamp": 1}))
    error = read_worker_error(path)
    assert error is not None and error.traceback == ""
    assert error.message.startswith("RuntimeError: x") and len(error.message) == MAX_ERROR_MESSAGE_CHARS


def test_the_failure_event_names_the_workers_exception() -> None:
    driver = Driver(mode=common_pb2.JOB_MODE_RESTART)
    formed(driver, "a", "b")
    traceback = 'Traceback (most recent call last):\n  File "train.py", line 9, in main\nValueError: boom 42'
    driver.say("b", worker_exited=launcher_pb2.WorkerExited(generation=1, local_rank=0, pid=77, exit_code=1,
                                                             error="ValueError: boom 42", traceback=traceback))
    failure = driver.event("failure_detected")
    assert failure.reason == "worker rank 1 (pid 77) exit code 1: ValueError: boom 42"
    assert failure.fields == {"cause": "worker_exit", "error": "ValueError: boom 42", "traceback": traceback}
    shown = _event_line(admin_pb2.Event(kind=failure.kind, reason=failure.reason, unit_id="b",
                                        fields={k: str(v) for k, v in failure.fields.items()}))
    first, *rest = shown.splitlines()
    assert "boom 42" in first and "cause=worker_exit" in first and "traceback" not in first
    assert rest == ["    traceback:", "      Traceback (most recent call last):",
                    '        File "train.py", line 9, in main', "      ValueError: boom 42"]


@pytest.mark.parametrize(("make", "why"), [(None, "No such file or directory"),
                                           ("not executable", "Permission denied")])
def test_a_command_that_cannot_be_run_says_so_in_its_error_file(tmp_path: Path, make: str | None, why: str) -> None:
    """A job whose command is not there (a typo, a path of another machine) or not
    executable: the worker exits 127, as under a shell, and its error file says which
    command and why, so the job's failure names them, not only the exit code."""
    import asyncio
    import os

    from tidal.launcher.workers import start_workers

    command = tmp_path / "train.sh"
    if make is not None:
        command.write_text("echo never\n")
    error_file = tmp_path / "errors" / "local-rank-0.json"

    async def run() -> int:
        exits: list[int] = []
        group = start_workers([str(command), "--lr", "3"], [{**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}],
                              generation=1, first_rank=0, working_dir="", progress_files=[tmp_path / "progress"],
                              error_files=[error_file], on_exit=lambda _, code: exits.append(code))
        await asyncio.wait_for(group.workers[0].exited, timeout=30)
        return exits[0]

    assert asyncio.run(run()) == 127
    error = read_worker_error(error_file)
    assert error is not None and error.message == f"cannot run {command}: {why}"
