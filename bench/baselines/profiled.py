"""Run a Python script under cProfile, timed by this thread's CPU clock (the training
thread's own CPU, not the wall clock, which a peer's pace and the machine's other tenants
set); the profile goes to $TIDAL_PROFILE_DIR/profile-<pid>.prof when the script ends.
Used by bench/overhead_profile.py: `python profiled.py SCRIPT ARGS...`."""

from __future__ import annotations

import cProfile
import os
import runpy
import sys
import time


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        profiler.disable()
        profiler.dump_stats(os.path.join(os.environ["TIDAL_PROFILE_DIR"], f"profile-{os.getpid()}.prof"))


if __name__ == "__main__":
    main()
