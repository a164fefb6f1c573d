from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from tidal.controller import cli
from tidal.controller.logs import configure_logging

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def test_json_logs_when_not_a_terminal() -> None:
    stream = io.StringIO()
    configure_logging(stream=stream)
    structlog.get_logger().bind(job="job-1", generation=3).info("world_reformed", world_size=2)
    record = json.loads(stream.getvalue())
    assert record["event"] == "world_reformed" and record["job"] == "job-1" and record["generation"] == 3
    assert record["level"] == "info" and record["timestamp"].endswith("Z")


def test_console_logs_on_request() -> None:
    stream = io.StringIO()
    configure_logging(stream=stream, json=False)
    structlog.get_logger().info("unit_preempted", unit="u1")
    assert "unit_preempted" in stream.getvalue() and "u1" in stream.getvalue()


def test_cli_rejects_unknown_commands_clearly() -> None:
    result = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "frobnicate"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_tidal_nodes_says_when_slurm_is_missing(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path), "SLURM_CONF": str(tmp_path / "none.conf"), "TIDAL_SLURM_BACKEND": "cli"}
    result = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "nodes"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == cli.EXIT_SLURM_UNAVAILABLE
    assert "Slurm did not answer" in result.stderr and "not found" in result.stderr


def test_daemons_refuse_bad_configuration_with_exit_2(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tidal.controller.daemon", "--state-dir", str(tmp_path),
                             "--set", "heartbeat_timeout_s=0.5"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "heartbeat_timeout_s (0.5) must exceed heartbeat_interval_s" in result.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    result = subprocess.run([sys.executable, "-m", "tidal.launcher.agent", "--controller", "127.0.0.1:1",
                             "--job", "j"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2 and "no job secret" in result.stderr


@pytest.mark.parametrize("ca", ["missing", "empty variable"])
def test_a_launcher_whose_tls_ca_cannot_be_read_says_so_at_once_with_exit_2(tmp_path: Path, ca: str) -> None:
    """--tls-ca naming no file, or $TIDAL_TLS_CA set but empty (a batch script's export
    with TLS off, which argparse made the path "."): the link read it at its first session
    and ended there unseen, and the launcher waited out --connect-timeout (10 minutes by
    default), then exited 1 with a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    env["TIDAL_JOB_SECRET"] = "s"
    argv = [sys.executable, "-m", "tidal.launcher.agent", "--controller", "127.0.0.1:1", "--job", "j",
            "--unit", "u1", "--address", "127.0.0.1"]
    if ca == "missing":
        argv += ["--tls-ca", str(tmp_path / "ca.pem"), "--connect-timeout", "120"]
    else:
        env["TIDAL_TLS_CA"] = ""
        argv += ["--connect-timeout", "3"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    if ca == "missing":
        assert result.returncode == 2, result.stderr[-2000:]
        assert "cannot read the TLS CA certificate (--tls-ca)" in result.stderr and "ca.pem" in result.stderr
        assert "Traceback" not in result.stderr
    else:
        # An empty variable is no CA: a plain connection, which here finds no controller.
        assert result.returncode == 4, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("case", ["state folder under a file", "metrics port taken", "TLS key missing"])
def test_a_controller_that_cannot_get_what_it_needs_at_start_says_what_in_one_line(tmp_path: Path, case: str) -> None:
    """The state folder cannot be made (a path under a file, a read-only mount), the metrics
    port is taken, a TLS file is not there: exit 1 with controller_start_failed naming it,
    not a traceback (an admin reads one line in `journalctl -u tidal-controller`)."""
    import socket

    options = ["--state-dir", str(tmp_path / "state"), "--unix-socket", str(tmp_path / "controller.sock"),
               "--listen", "127.0.0.1:0"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if case == "state folder under a file":
            (tmp_path / "file").write_text("")
            options[1], expected = str(tmp_path / "file" / "state"), "Not a directory"
        elif case == "metrics port taken":
            address = f"127.0.0.1:{taken.getsockname()[1]}"
            options += ["--set", f"metrics_listen={address}"]
            expected = f"cannot serve metrics on {address}: Address already in use"
        else:
            options += ["--set", f"tls_cert_file={tmp_path / 'cert.pem'}",
                        "--set", f"tls_key_file={tmp_path / 'key.pem'}"]
            expected = f"No such file or directory ({tmp_path / 'key.pem'})"
        result = subprocess.run([sys.executable, "-m", "tidal.controller.daemon", *options], capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    failed = [json.loads(line) for line in result.stderr.splitlines() if "controller_start_failed" in line]
    assert len(failed) == 1 and expected in failed[0]["reason"], result.stderr


@pytest.mark.parametrize("entry", ["tidal.launcher.agent", "torch, tidal.train"])
def test_a_launcher_or_worker_starts_without_importing_rich_and_rich_stays_importable(entry: str) -> None:
    # structlog imports rich (and pygments) for its console tracebacks when installed: a
    # tenth of a CPU-second on every launcher start, before it registers, and 0.15 s of a
    # training script's start (after torch's), which a grow waits for.
    if subprocess.run([sys.executable, "-c", "import rich"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("rich is not installed here: nothing to hide")
    probe = (f"import sys, {entry}, structlog; "
             "print(sorted(m for m in ('rich', 'pygments') if m in sys.modules)); "
             "import rich.console; print('rich.console' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True"]


def test_output_piped_into_a_reader_that_went_ends_quietly() -> None:
    """`tidal recipes | head -1`: the reader closes the pipe before the rest is written.
    The CLI stops quietly, as a program SIGPIPE ends does (141), not with "[Errno 32]
    Broken pipe" on stderr (nor Python's "Exception ignored" at exit). (The job commands:
    tests/integration/test_cli.py.)"""
    result = run_into_a_closed_pipe([sys.executable, "-m", "tidal.controller.cli", "recipes"])
    assert (result.returncode, result.stderr) == (cli.EXIT_BROKEN_PIPE, "")


def run_into_a_closed_pipe(command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` with its stdout a pipe whose reader has gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)


def test_job_commands_refuse_text_that_is_not_utf8_in_one_line(tmp_path: Path) -> None:
    """A file name, an argument or a folder that is not UTF-8 (Linux allows any bytes)
    cannot travel in the controller's messages: a one-line usage error naming it, not a
    traceback (the request is refused before any controller is asked)."""
    socket = str(tmp_path / "no-controller.sock")
    folder = os.path.join(os.fsencode(tmp_path), b"run-\xff")
    os.mkdir(folder)
    for argv, cwd in (([b"submit", b"--", b"python", b"train-\xff.py"], None),
                      ([b"submit", b"--", b"true"], folder),
                      ([b"status", b"job-\xfe"], None), ([b"cancel", b"job-\xfe"], None)):
        result = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", socket, *argv],
                                capture_output=True, timeout=60, cwd=cwd or tmp_path)
        stderr = result.stderr.decode(errors="replace")
        assert result.returncode == cli.EXIT_USAGE, (argv, stderr)
        assert "is not UTF-8" in stderr and "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
