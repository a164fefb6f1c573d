"""A leaving worker ends right after its exit handlers (`tidal.train.quick_exit`): what a
script relies on at exit still happens, the interpreter's teardown does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from pathlib import Path
    from tidal.train.quick_exit import end_after_exit_handlers

    folder = Path(sys.argv[1])
    atexit.register(lambda: (folder / "handler").write_text("ran"))
    atexit.register(lambda: 1 / 0)  # a handler that raises does not stop the others
    metrics = open(folder / "metrics.txt", "w")  # never closed: its buffer must reach the file
    metrics.write("step 1 loss 0.5\\n" * 100)

    class Finalized:
        def __del__(self):
            (folder / "finalized").write_text("teardown ran")

    kept = Finalized()
    if sys.argv[2] == "armed":
        end_after_exit_handlers(0)
    raise SystemExit(0)
""")


def run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=60)


def test_a_leaving_worker_runs_its_exit_handlers_and_keeps_its_unclosed_files_but_skips_the_teardown(
        tmp_path: Path) -> None:
    # The same script without the quick exit: the teardown finalizes module globals.
    plain = tmp_path / "plain"
    plain.mkdir()
    assert run(plain, "plain").returncode == 0
    assert (plain / "finalized").exists()

    armed = tmp_path / "armed"
    armed.mkdir()
    finished = run(armed, "armed")
    assert finished.returncode == 0, finished.stderr
    assert "ZeroDivisionError" in finished.stderr
    assert (armed / "handler").read_text() == "ran"
    assert (armed / "metrics.txt").read_text() == "step 1 loss 0.5\n" * 100
    assert not (armed / "finalized").exists()
