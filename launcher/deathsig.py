"""Exec a command that dies with its launcher: `python -m tidal.launcher.deathsig PID CMD...`.

PR_SET_PDEATHSIG has to be set in the child, and running Python code between fork and
exec in a launcher that has gRPC threads is not safe (a child crashed in our tests). So
the launcher starts this small program with a plain fork+exec, and it sets the signal and
execs the worker; the setting survives exec. If the launcher (PID) is already gone, the
worker is not started at all. A command that cannot be run (no such file, not executable)
exits 127, as a shell's does, and says why in the worker's error file
(TORCHELASTIC_ERROR_FILE, when its environment names one), where the launcher reads a
failed worker's own account: the job's events then name the command and the error, not
only the exit code. SIGPIPE and SIGXFSZ, which Python ignores at its start (and an exec
keeps ignored), are set back to their default first, as subprocess's `restore_signals`
does for torchrun's workers: a shell script's `yes | head` ends its writer by SIGPIPE, not
with EPIPE and "Broken pipe"."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
# What Python ignores at its start, and subprocess.Popen(restore_signals=True) restores.
_RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m tidal.launcher.deathsig LAUNCHER_PID COMMAND [ARG...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        print(f"deathsig: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    if os.getppid() != int(argv[0]):
        return 1
    command = argv[1:]
    for signum in _RESTORED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (Python's again: say why, even to a closed pipe)
        message = f"cannot run {command[0]}: {error.strerror}"
        print(f"deathsig: {message}", file=sys.stderr)
        _write_error_file(message)
        return 127
    return 0  # not reached


def _write_error_file(message: str) -> None:
    """`message` as torch's ErrorHandler writes a failure ({"message": ...}), into the file
    TORCHELASTIC_ERROR_FILE names (none named, or not writable: only stderr has it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as file:
            json.dump({"message": message}, file)
    except OSError as error:
        print(f"deathsig: cannot write the error file {path}: {error.strerror}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
