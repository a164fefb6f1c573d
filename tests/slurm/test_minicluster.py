"""scripts/minicluster's own promises, on a second, throw-away cluster (2 nodes, its own
ports and state folder) beside the one the other tests use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
SCRIPT = Path(__file__).resolve().parent.parent.parent / "scripts" / "minicluster"


def minicluster(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--state-dir", str(state_dir), *args],
                          capture_output=True, text=True, timeout=180)


def marked_processes(state_dir: Path) -> list[int]:
    needle = f"TIDAL_MINICLUSTER={state_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_up_is_idempotent_and_down_stops_everything(mini_cluster: dict, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the mini cluster runs as root")
    state_dir = tmp_path / "cluster"
    try:
        first = minicluster(state_dir, "up", "--nodes", "2", "--port-base", "17600")
        assert first.returncode == 0, first.stderr
        record = json.loads((state_dir / "cluster.json").read_text())
        pids = [d["pid"] for d in record["daemons"].values()]
        assert set(record["daemons"]) == {"munged", "slurmctld", "slurmd-n1", "slurmd-n2"}

        again = minicluster(state_dir, "up", "--nodes", "2", "--port-base", "17600")
        assert again.returncode == 0 and "already up" in again.stdout
        assert [d["pid"] for d in json.loads((state_dir / "cluster.json").read_text())["daemons"].values()] == pids

        env = dict(os.environ, SLURM_CONF=str(state_dir / "slurm.conf"))
        subprocess.run(["sbatch", "--parsable", "--output=/dev/null"], input="#!/bin/sh\nsleep 600\n", env=env,
                       check=True, capture_output=True, text=True, timeout=30)
        status = minicluster(state_dir, "status")
        assert status.returncode == 0 and "slurmctld" in status.stdout
    finally:
        down = minicluster(state_dir, "down")
    assert down.returncode == 0, down.stderr
    assert not any(alive(pid) for pid in pids)
    assert marked_processes(state_dir) == [], "slurmstepd or job processes outlived `down`"
    assert minicluster(state_dir, "status").returncode == 1
