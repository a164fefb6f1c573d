"""A leaving worker's end without the interpreter's teardown.

A worker that leaves the job (a preemption, a resize, a drain) raises SystemExit(0) through
the script's loop: its `finally` blocks and context managers run, then Python's shutdown
joins the script's threads and runs its `atexit` handlers. What comes after that,
finalizing every module, took 1.8 s in a process that imported torch (measured on this
machine from the worker's `left` record to its exit; `gdb` showed a garbage collection in
`finalize_modules` over torch's modules and objects), and the unit's node stays allocated until the process is gone: an
urgent job that preempted it waits that long for its node.

`end_after_exit_handlers(code)` arms the process to skip that part: a handler registered
last runs first, runs every other `atexit` handler itself (the script's, logging's, a
profiler's), flushes every open Python file that buffers writes (a metrics file the script
never closed loses nothing), and ends the process with `os._exit(code)`. A handler that
raises is reported as Python reports it and the rest still run."""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys


class _Armed:
    code: int | None = None
    ending = False


def end_after_exit_handlers(code: int) -> None:
    """From now on, the process ends with `code` right after its `atexit` handlers."""
    if _Armed.code is not None:
        return
    _Armed.code = code
    atexit.register(_end)


def _end() -> None:
    # Once: should `unregister` not take it out of the handlers still to run, the call
    # below finds it ending and returns.
    if _Armed.ending or _Armed.code is None:
        return
    _Armed.ending = True
    atexit.unregister(_end)
    try:
        atexit._run_exitfuncs()
        flush_open_files()
    finally:
        os._exit(_Armed.code)


def flush_open_files() -> None:
    """Flush what Python's teardown would: every open file object's buffered writes."""
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    for candidate in gc.get_objects():
        # type(), not isinstance(): a lazy module's proxy must not be asked for its class.
        if issubclass(type(candidate), io.IOBase):
            _flush(candidate)


def _flush(stream: object) -> None:
    try:
        if stream is not None and not stream.closed and stream.writable():  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
    except (OSError, ValueError, AttributeError):
        pass
