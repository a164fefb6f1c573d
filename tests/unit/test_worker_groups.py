"""A worker's process group on this node: what a worker that exited on its own (a crash, an
OOM kill) left running in it is stopped with its group, never left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from tidal.launcher.workers import WorkerGroup, start_workers


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
    async def scenario() -> tuple[bool, bool, bool]:
        exits: list[int] = []
        group = start(tmp_path, ["sleep 300 & exit 3", "sleep 300 & exit 0", "sleep 300 & exec sleep 300"], exits)
        crashed, finished, running = group.workers
        try:
            while not (crashed.exited.done() and finished.exited.done()):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            left = group_alive(crashed.pid), group_alive(finished.pid), group_alive(running.pid)
            await group.stop(grace_s=0.5)
            return (*left[:2], left[2] and not group_alive(running.pid))
        finally:
            for worker in group.workers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.pid, signal.SIGKILL)

    assert asyncio.run(scenario()) == (False, False, True)
