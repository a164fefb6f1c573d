"""The replica's swappable shard group (`tidal.train.shard_group`): FSDP2 keeps training
over it when a shard rank's process is replaced by a new one given the lost shard, and the
result equals a one-process run. Real processes, gloo on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("shard_group_worker.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(role: str, port: int, folder: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), role, str(port), str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_replaced_shard_rank_continues_fsdp_training_equal_to_one_process(tmp_path: Path) -> None:
    port = free_port()
    first = start("first", port, tmp_path)
    lost = start("lost", port, tmp_path)
    try:
        lost_output, _ = lost.communicate(timeout=120)
        assert lost.returncode == 0, lost_output
        replacement = start("replacement", port, tmp_path)
        replacement_output, _ = replacement.communicate(timeout=120)
        first_output, _ = first.communicate(timeout=120)
    finally:
        for process in (first, lost):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert replacement.returncode == 0, replacement_output
    assert first.returncode == 0, first_output
    # Between the broken generation and the next one, FSDP2's collectives fail at once.
    assert "not connected between generations" in first_output
    worst = float(first_output.rsplit("max relative difference", 1)[1].split()[0])
    assert worst < 1e-9, first_output


def test_a_shard_group_is_installed_once_per_process() -> None:
    code = ("from tidal.train import shard_group\n"
            "shard_group.install(0, 1)\n"
            "try:\n    shard_group.install(0, 1)\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert output.returncode == 0, output.stderr
    assert "refused: the default process group is already initialized" in output.stdout


def test_the_shard_groups_connection_is_closed_before_the_interpreter_tears_down() -> None:
    # Left to the teardown, a gloo thread letting go of a finished collective's tensors can
    # ask for the GIL while the interpreter finalizes, and the worker dies of SIGABRT after
    # its training completed (`shard_group.close_before_teardown`). A handler registered
    # before `install` runs after install's own.
    code = ("import atexit, datetime\n"
            "import torch, torch.distributed as dist\n"
            "atexit.register(lambda: print('connected at teardown:', group.connected, flush=True))\n"
            "from tidal.train import shard_group\n"
            "group = shard_group.install(0, 1)\n"
            "wait = datetime.timedelta(seconds=30)\n"
            "group.connect('gloo', dist.HashStore(), generation=1, connect_timeout=wait, timeout=wait)\n"
            "total = torch.ones(4)\n"
            "dist.all_reduce(total)\n"
            "print('all_reduce:', total.tolist(), flush=True)\n")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert output.returncode == 0, output.stderr
    assert "all_reduce: [1.0, 1.0, 1.0, 1.0]" in output.stdout
    assert "connected at teardown: False" in output.stdout, output.stdout
