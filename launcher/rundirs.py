"""A launcher's run folder (`tidal-<unit>-…` in the temporary directory: its workers'
sockets, progress and error files), made with a note of its owner, and the folders of
launchers that died without removing theirs (SIGKILL, a lost node's reboot skipped),
removed by the next launcher of the same user on that node.

The owner note is the launcher's pid, its start time in clock ticks since boot
(`/proc/<pid>/stat`, field 22: a pid reused by another process does not keep a dead
launcher's folder alive) and its pid namespace. A folder is judged only by a launcher in
the same pid namespace (containers sharing the temporary directory see other pids); one
without the note (made by an older launcher, or by anything else named so), or that
another user owns, is left alone."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "tidal-"
OWNER_FILE = "owner"


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), or None if there is none (or
    only its zombie, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses;
    # then the state (field 3) and, 19 fields on, the start time (field 22).
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def owner_note(pid: int) -> str:
    return f"{pid} {process_start_ticks(pid)} {pid_namespace()}\n"


def is_abandoned(folder: Path) -> bool:
    """Whether `folder` is a run folder whose launcher is gone: its owner note names a
    process of this pid namespace that no longer exists (or a pid now another process's)."""
    try:
        pid_text, ticks_text, namespace = (folder / OWNER_FILE).read_text().split()
        pid, ticks = int(pid_text), int(ticks_text)
    except (OSError, ValueError):
        return False
    if namespace != pid_namespace() or namespace == "unknown":
        return False
    return process_start_ticks(pid) != ticks


def sweep_abandoned(directory: Path | None = None) -> list[Path]:
    """Remove the run folders in `directory` (default: the temporary directory) that this
    user owns and whose launcher is gone; return them."""
    directory = directory or Path(tempfile.gettempdir())
    removed: list[Path] = []
    uid = os.getuid()
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for folder in entries:
        try:
            if not folder.name.startswith(PREFIX) or folder.is_symlink() or not folder.is_dir() \
                    or folder.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if is_abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


# A Unix socket's path holds at most 107 bytes (sun_path's 108, with its NUL); the workers'
# control socket is the run folder's longest path that must fit.
SOCKET_PATH_MAX = 107
CONTROL_SOCKET = "control.sock"
SHORT_TEMPORARY_DIRECTORY = "/tmp"


def make_run_dir(name: str) -> Path:
    """A new run folder `tidal-<name>-…` in the temporary directory, noting its owner; in
    /tmp where the temporary directory's path is too long for the workers' control socket
    (TMPDIR set to a job's scratch folder, say). OSError if neither will do."""
    prefix = f"{PREFIX}{name}-"
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if len(os.fsencode(folder / CONTROL_SOCKET)) > SOCKET_PATH_MAX:
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=SHORT_TEMPORARY_DIRECTORY))
        if len(os.fsencode(folder / CONTROL_SOCKET)) > SOCKET_PATH_MAX:
            folder.rmdir()
            raise OSError(f"no run folder whose control socket's path fits in {SOCKET_PATH_MAX} bytes "
                          f"(the temporary directory {tempfile.gettempdir()}, then {SHORT_TEMPORARY_DIRECTORY})")
    (folder / OWNER_FILE).write_text(owner_note(os.getpid()))
    return folder
