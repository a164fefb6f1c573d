"""What a torchrun script sees under a real launcher: the environment torchrun sets, its
exception (written by torch's `@record`) in the failure event, the signal dispositions a
worker that is no Python program starts with, and a rendezvous store that listens on the
launcher's address only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import TidalRun, wait_until
from tests.listening import listening_addresses, store_server_pid
from tidal.proto import admin_pb2

pytestmark = pytest.mark.integration

# Writes the torchrun variables it got, then fails the way torchrun users make it report.
FAILING_SCRIPT = '''
import json, os, sys
from torch.distributed.elastic.multiprocessing.errors import record

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE")


@record
def main() -> None:
    with open(sys.argv[1], "w") as out:
        json.dump({name: os.environ.get(name) for name in NAMES}, out)
    raise ValueError("boom 42")


if __name__ == "__main__":
    main()
'''


def test_a_record_decorated_workers_exception_is_in_the_failure_event(tidal_run: TidalRun, tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    seen = tmp_path / "environment.json"
    job = tidal_run.submit(min_replicas=1, max_replicas=1, command=[sys.executable, str(script), str(seen)])
    tidal_run.start_launcher("u1")

    failure = tidal_run.controller.wait_event(job.job_id, "failure_detected", timeout=60)
    assert failure.fields["cause"] == "worker_exit"
    assert failure.reason.endswith("exit code 1: ValueError: boom 42"), failure.reason
    assert failure.fields["error"] == "ValueError: boom 42"
    assert 'raise ValueError("boom 42")' in failure.fields["traceback"]
    shown = subprocess.run([sys.executable, "-m", "tidal.controller.cli", "--socket", str(tidal_run.controller.socket),
                            "events", job.job_id], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "ValueError: boom 42" in shown.stdout, shown.stdout + shown.stderr

    env = json.loads(seen.read_text())
    assert env == {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": "0",
                   "ROLE_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_MAX_RESTARTS": "2147483647", "TORCHELASTIC_RUN_ID": job.job_id,
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert env["TORCHELASTIC_ERROR_FILE"].endswith("/errors/generation-1/local-rank-0.json")


# A worker that is a shell script (torchrun --no-python): how a pipe whose reader went
# ends for its writer, and the signals it started with ignored (/proc's SigIgn mask).
SHELL_SCRIPT = """#!/bin/bash
yes | head -n 1 > /dev/null
echo "${PIPESTATUS[0]}" > "$1.partial"
grep '^SigIgn:' /proc/$$/status | cut -f2 >> "$1.partial"
mv "$1.partial" "$1"
"""


def test_a_shell_worker_starts_with_sigpipe_and_sigxfsz_at_their_default(tidal_run: TidalRun, tmp_path: Path) -> None:
    # torchrun starts its workers with subprocess.Popen, whose restore_signals puts back
    # the dispositions Python ignores at its start: a writer to a closed pipe dies of
    # SIGPIPE (exit status 141 in the shell), as in a terminal.
    script = tmp_path / "pipes.sh"
    script.write_text(SHELL_SCRIPT)
    script.chmod(0o755)
    seen = tmp_path / "pipes.txt"
    tidal_run.submit(min_replicas=1, max_replicas=1, command=[str(script), str(seen)])
    tidal_run.start_launcher("u1")

    status, ignored = wait_until(lambda: seen.exists() and seen.read_text().split(), 60, "the shell worker's report")
    assert status == str(128 + signal.SIGPIPE), f"yes | head: yes exited {status}, not killed by SIGPIPE"
    mask = int(ignored, 16)
    assert not mask & (1 << (signal.SIGPIPE - 1)) and not mask & (1 << (signal.SIGXFSZ - 1)), ignored


def test_the_rendezvous_store_listens_on_the_launchers_address_only(tidal_run: TidalRun) -> None:
    tidal_run.submit(min_replicas=1, max_replicas=1)
    launcher = tidal_run.start_launcher("u1", extra=("--address", "127.0.0.2"))
    # The ranks of generation 1 meet at this launcher's store, on 127.0.0.2, and train.
    tidal_run.wait_steps(3, world_size=1)
    assert tidal_run.job().state == admin_pb2.JOB_STATE_RUNNING
    # Generation 1's store and the spare for the next one, served by the launcher's store
    # server (torch stays out of the launcher); nothing on every interface.
    server = store_server_pid(launcher.pid)
    assert server is not None
    stores = wait_until(lambda: len(found := listening_addresses(server)) >= 2 and found, 10,
                        "the launcher's two stores")
    assert {host for host, _ in stores} == {"127.0.0.2"}, stores
    # The launcher handed its copies of the listening sockets over.
    assert not {port for _, port in stores} & {port for _, port in listening_addresses(launcher.pid)}


def test_a_launcher_refuses_an_address_that_is_not_its_nodes(tidal_run: TidalRun) -> None:
    tidal_run.submit(min_replicas=1, max_replicas=1)
    launcher = tidal_run.start_launcher("u1", extra=("--address", "no-such-host.invalid"))
    assert launcher.process is not None and launcher.process.wait(60) == 2
    assert "cannot serve the rendezvous store on no-such-host.invalid" in launcher.log_path.read_text()
