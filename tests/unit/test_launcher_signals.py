"""Signals to a registered launcher, as a user's terminal or an operator sends them: a real
launcher process, its worker, and a controller on a real gRPC server on loopback that
registers it, starts one generation and then only listens."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from tidal.proto import common_pb2, launcher_pb2, launcher_pb2_grpc


class StartingController(launcher_pb2_grpc.LauncherServiceServicer):
    """Registers the launcher in restart mode with `command`, starts generation 1 on it
    alone, and keeps what the launcher says."""

    def __init__(self, command: list[str], working_dir: Path) -> None:
        self.command = command
        self.working_dir = working_dir
        self.read: list[launcher_pb2.LauncherMessage] = []

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        register = first.register
        registered = launcher_pb2.Registered(mode=common_pb2.JOB_MODE_RESTART, procs_per_node=1,
                                             command=self.command, working_dir=str(self.working_dir))
        registered.heartbeat_interval.FromSeconds(1)
        await context.write(launcher_pb2.ControllerMessage(registered=registered))
        table = common_pb2.RankTable(world_size=1, groups=1, assignments=[common_pb2.RankAssignment(
            unit_id=register.unit_id, nodes=list(register.nodes), group_rank=0, first_rank=0, procs_per_node=1)])
        await context.write(launcher_pb2.ControllerMessage(generation=launcher_pb2.Generation(
            generation=1, rank_table=table, rendezvous=common_pb2.Rendezvous(
                host="127.0.0.1", port=register.store_port, host_unit_id=register.unit_id))))
        while (message := await context.read()) is not grpc.aio.EOF:
            self.read.append(message)

    def said(self, kind: str) -> list[launcher_pb2.LauncherMessage]:
        return [m for m in self.read if m.WhichOneof("body") == kind]


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT])
def test_a_hangup_or_quit_asks_to_leave_as_sigterm_does_and_the_worker_gets_its_grace(
        tmp_path: Path, signum: signal.Signals) -> None:
    """The terminal a launcher was started from closes (SIGHUP), or an operator types ^\\
    (SIGQUIT), as torchrun's agent takes both. The launcher died at once: its worker
    SIGKILLed by its death signal without the grace a checkpoint on SIGTERM needs, the
    controller told nothing (the unit lost at the heartbeat timeout) and the run folder
    left behind."""
    ready, cleaned = tmp_path / "ready", tmp_path / "cleaned-up"
    worker = f'trap "touch {cleaned}; exit 0" TERM; touch {ready}; while :; do sleep 0.1; done'
    controller = StartingController(["sh", "-c", worker], tmp_path)
    run_root = Path(tempfile.mkdtemp(prefix="tst-", dir="/tmp"))  # short: the control socket's path fits

    async def scenario() -> int:
        server = grpc.aio.server()
        launcher_pb2_grpc.add_LauncherServiceServicer_to_server(controller, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDAL_", "SLURM_"))}
        env.update({"TIDAL_JOB_SECRET": "s", "TMPDIR": str(run_root)})
        launcher = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tidal.launcher.agent", "--controller", f"127.0.0.1:{port}", "--job", "j",
            "--unit", "u1", "--address", "127.0.0.1", "--leave-timeout", "1", "--stop-grace", "30",
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert time.monotonic() < deadline, "the worker never started"
                await asyncio.sleep(0.1)
            launcher.send_signal(signum)
            return await asyncio.wait_for(launcher.wait(), timeout=60)
        finally:
            if launcher.returncode is None:
                launcher.kill()
                await launcher.wait()
            await server.stop(grace=None)

    try:
        returncode = asyncio.run(scenario())
        left = sorted(p.name for p in run_root.iterdir())
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
    assert returncode == 0
    assert [m.leave_request.cause for m in controller.said("leave_request")] == [launcher_pb2.LEAVE_CAUSE_PREEMPTED]
    assert cleaned.exists(), "the worker had its grace"
    assert left == [], "the run folder was removed"
