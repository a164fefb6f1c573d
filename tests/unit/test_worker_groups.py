"""A worker's process group on this node: what a worker that exited on its own (a crash, an
OOM kill) left running in it is stopped with its group, never left behind; a worker that
SIGKILL does not end is given up on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import structlog

from tidal.launcher import workers as workers_module
from tidal.launcher.follower import Follower, FollowerOptions, LeaderSaid
from tidal.launcher.lifecycle import EXIT_UNIT_FAILED, LauncherState
from tidal.launcher.nodes import UnitNodes
from tidal.launcher.workers import Worker, WorkerGroup, start_workers
from tidal.proto import launcher_pb2


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` runs (a zombie, not reaped where init does not
    reap, runs nothing)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def start(tmp_path: Path, commands: list[str], exits: list[int]) -> WorkerGroup:
    """One worker per shell command, in its own process group (as a unit's workers are)."""
    group = start_workers(["sh", "-c", commands[0]], [dict(os.environ)], generation=1, first_rank=0, working_dir="",
                          progress_files=[tmp_path / "p0"], error_files=[tmp_path / "e0"],
                          on_exit=lambda _, code: exits.append(code))
    for local, command in enumerate(commands[1:], start=1):
        more = start_workers(["sh", "-c", command], [dict(os.environ)], generation=1, first_rank=local,
                             working_dir="", progress_files=[tmp_path / f"p{local}"],
                             error_files=[tmp_path / f"e{local}"], on_exit=lambda _, code: exits.append(code))
        group.workers.extend(more.workers)
    return group


def test_what_a_worker_that_exited_started_is_killed_with_its_exit(tmp_path: Path) -> None:
    """The worker starts a child (a data loader's worker, a helper) and crashes, or exits
    0: the child is killed at once (it ran on for the rest of the job, its group not
    signalled by the launcher's stop since its worker had exited). Its sibling, another
    worker, runs on until its own stop."""
    async def scenario() -> tuple[bool, bool, bool, bool]:
        exits: list[int] = []
        group = start(tmp_path, ["sleep 300 & exit 3", "sleep 300 & exit 0", "sleep 300 & exec sleep 300"], exits)
        crashed, finished, running = group.workers
        try:
            while not (crashed.exited.done() and finished.exited.done()):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            left = group_alive(crashed.pid), group_alive(finished.pid), group_alive(running.pid)
            await group.stop(grace_s=0.5)
            # The stop returns once the worker itself is gone; the child it started got the
            # same SIGKILL but may not have been scheduled to die yet (a loaded host).
            deadline = time.monotonic() + 10.0
            while group_alive(running.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return (*left, not group_alive(running.pid))
        finally:
            for worker in group.workers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.pid, signal.SIGKILL)

    # (The crashed's child and the finished's are gone; the sibling ran until its stop.)
    assert asyncio.run(scenario()) == (False, False, True, True)


def test_a_worker_that_sigkill_does_not_end_is_given_up_on_and_its_launcher_fails_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker in uninterruptible sleep (D state: a hung NFS mount, a wedged GPU driver)
    does not die on SIGKILL until the kernel call returns, which may be never. The stop
    waited for its exit for ever: the launcher neither went on nor exited, and nothing said
    why. It gives up KILL_WAIT_S after the SIGKILL, and the launcher fails naming the
    worker. (The stuck worker here is a process outside the process group the launcher
    signals: to the launcher, the same as one the kernel does not let die.)"""
    monkeypatch.setattr(workers_module, "KILL_WAIT_S", 0.5, raising=False)
    run_root = Path(tempfile.mkdtemp(prefix="tst-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(run_root))
    stuck = subprocess.Popen(["sleep", "300"])  # not a group leader: killpg(its pid) reaches nothing

    async def scenario() -> tuple[LauncherState, int, str]:
        follower = Follower(FollowerOptions(job_id="j", unit_id="u1", secret="s", slurm_job_id=7, layout=UnitNodes(
            nodes=("n1", "n2"), index=1, leader_address="127.0.0.1", ports=(1,))))
        try:
            worker = Worker(local_rank=0, rank=1, process=stuck, progress_file=tmp_path / "p0",
                            exited=asyncio.get_running_loop().create_future(), error_file=tmp_path / "e0")
            follower.workers, follower.generation, follower.state = WorkerGroup(1, [worker]), 1, LauncherState.RUNNING
            stop = launcher_pb2.LeaderMessage(stop=launcher_pb2.NodeStop(generation=1))
            stop.stop.grace.FromMilliseconds(200)
            follower._handle(LeaderSaid(stop))
            # The stop's end (WorkersStopped), within the grace and the bound.
            follower._handle(await asyncio.wait_for(follower.events.get(), timeout=10.0))
            return follower.state, follower.exit_code, follower.exit_reason
        finally:
            shutil.rmtree(follower.run_dir, ignore_errors=True)

    try:
        with structlog.testing.capture_logs() as logged:
            state, code, reason = asyncio.run(scenario())
    finally:
        stuck.kill()
        stuck.wait()
        shutil.rmtree(run_root, ignore_errors=True)
    assert [e["pid"] for e in logged if e["event"] == "worker_unkillable"] == [stuck.pid]
    assert (state, code) == (LauncherState.FAILED, EXIT_UNIT_FAILED)
    assert f"worker pid {stuck.pid} still there 0.5 s after SIGKILL" in reason
