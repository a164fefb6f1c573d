"""Run folders of launchers that died without removing theirs (SIGKILL) are removed by the
next launcher of the same user on the node; live launchers' folders, and anything else in
the temporary directory, are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.waiting import wait_for
from tidal.launcher.rundirs import (
    CONTROL_SOCKET,
    OWNER_FILE,
    SOCKET_PATH_MAX,
    make_run_dir,
    pid_namespace,
    process_start_ticks,
    sweep_abandoned,
)


@pytest.fixture
def temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def launcher_that_kills_itself(name: str, temporary: Path) -> subprocess.Popen[str]:
    """Another launcher process: it makes its run folder, prints it, and SIGKILLs itself."""
    return subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys, tempfile; tempfile.tempdir = sys.argv[1];"
         "from tidal.launcher.rundirs import make_run_dir; print(make_run_dir(sys.argv[2]), flush=True);"
         "sys.stdout.close(); os.kill(os.getpid(), signal.SIGKILL)", str(temporary), name],
        stdout=subprocess.PIPE, text=True)


def made_by_a_process_that_is_gone(name: str, temporary: Path) -> Path:
    """A run folder made by another launcher process, SIGKILLed and reaped since."""
    process = launcher_that_kills_itself(name, temporary)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == -9
    folder = Path(out.strip())
    assert folder.is_dir() and folder.parent == temporary
    return folder


def test_a_dead_launchers_folder_goes_and_a_live_ones_stays(temporary: Path) -> None:
    dead = made_by_a_process_that_is_gone("u1", temporary)
    (dead / "progress-0").write_text("x")
    live = make_run_dir("u2")
    assert live.name.startswith("tidal-u2-") and live.parent == temporary
    assert sweep_abandoned(temporary) == [dead]
    assert not dead.exists() and live.is_dir()


def test_a_launcher_killed_but_not_yet_reaped_is_gone(temporary: Path) -> None:
    # Its zombie keeps its /proc entry until its parent reaps it.
    process = launcher_that_kills_itself("u8", temporary)
    assert process.stdout is not None
    folder = Path(process.stdout.read().strip())
    try:
        wait_for("the launcher to be a zombie", lambda: Path(f"/proc/{process.pid}/stat").read_text().split(")")[1]
                 .split()[0] == "Z", timeout_s=30, interval_s=0.02)
        assert sweep_abandoned(temporary) == [folder]
    finally:
        process.wait(10)


def test_a_pid_now_another_processs_does_not_keep_a_folder(temporary: Path) -> None:
    # This process's pid, but not its start time: the pid was reused.
    reused = temporary / "tidal-u3-reused"
    reused.mkdir()
    ticks = process_start_ticks(os.getpid())
    assert ticks is not None
    (reused / OWNER_FILE).write_text(f"{os.getpid()} {ticks - 1} {pid_namespace()}\n")
    assert sweep_abandoned(temporary) == [reused]


def test_folders_without_a_note_of_this_pid_namespace_are_left_alone(temporary: Path) -> None:
    unnoted = temporary / "tidal-u4-old"  # an older launcher's, or anything else named so
    unnoted.mkdir()
    other_namespace = temporary / "tidal-u5-container"  # a container's, sharing /tmp
    other_namespace.mkdir()
    (other_namespace / OWNER_FILE).write_text("1 1 pid:[1]\n")
    garbled = temporary / "tidal-u6-garbled"
    garbled.mkdir()
    (garbled / OWNER_FILE).write_text("not a note")
    not_ours = temporary / "other-u7"
    not_ours.mkdir()
    (not_ours / OWNER_FILE).write_text("1 1 " + pid_namespace())
    assert sweep_abandoned(temporary) == []
    assert all(f.is_dir() for f in (unnoted, other_namespace, garbled, not_ours))


def test_a_temporary_directory_too_long_for_the_control_socket_gives_a_run_folder_in_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TMPDIR set to a job's scratch folder: the workers' control socket's path would pass
    the 107 bytes a Unix socket's path holds, and binding it failed the launcher at its
    start. The folder is made in /tmp instead."""
    scratch = tmp_path / ("scratch-" + "x" * (SOCKET_PATH_MAX - len(str(tmp_path))))
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    folder = make_run_dir("u7")
    try:
        assert folder.parent == Path("/tmp") and (folder / OWNER_FILE).exists()
        assert len(os.fsencode(folder / CONTROL_SOCKET)) <= SOCKET_PATH_MAX
        assert list(scratch.iterdir()) == [], "nothing left in the long folder"
    finally:
        (folder / OWNER_FILE).unlink()
        folder.rmdir()
