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


def test_what_a_crashed_worker_started_is_stopped_with_its_group(tmp_path: Path) -> None:
    """The worker starts a child (a data loader's worker, a helper) and crashes; the stop
    that follows (or the launcher's exit, or the next generation's start) kills the child,
    which would otherwise run on, holding what it holds, for the rest of the job."""
    async def scenario() -> tuple[bool, bool]:
        exits: list[int] = []
        group = start(tmp_path, ["sleep 300 & exit 3", "sleep 300 & exec sleep 300"], exits)
        crashed, running = group.workers
        try:
            while not crashed.exited.done():
                await asyncio.sleep(0.02)
            assert exits == [3] and crashed.group_lingers and group_alive(crashed.pid)
            await group.stop(grace_s=0.5)
            await asyncio.sleep(0.2)
            return group_alive(crashed.pid), group_alive(running.pid)
        finally:
            for worker in group.workers:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.pid, signal.SIGKILL)

    assert asyncio.run(scenario()) == (False, False)


def test_a_group_whose_workers_all_exited_has_its_leftovers_killed(tmp_path: Path) -> None:
    async def scenario() -> bool:
        exits: list[int] = []
        group = start(tmp_path, ["sleep 300 & exit 0"], exits)
        try:
            while not group.all_exited:
                await asyncio.sleep(0.02)
            group.kill_leftovers()
            await asyncio.sleep(0.2)
            return group_alive(group.workers[0].pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group.workers[0].pid, signal.SIGKILL)

    assert not asyncio.run(scenario())
