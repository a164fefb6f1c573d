"""A launcher's session ends cleanly only once the controller's job has handled what the
launcher said in it: a launcher takes that clean end as proof that its end-of-training
reports are safe (`ControllerLink.hold_written`). The controller's own servicer, job actor
and SQLite file, over real gRPC on loopback; the actor's loop is held back to stand for a
busy controller (or one killed before it got to the messages)."""

from __future__ import annotations

import asyncio
import os
import pwd
from pathlib import Path

import grpc
import pytest

from tidal.controller.config import ControllerConfig
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.server import Controller, LauncherServicer
from tidal.controller.store import StateStore
from tidal.proto import admin_pb2, common_pb2, launcher_pb2, launcher_pb2_grpc
from tidal.slurm.models import UnitOwner


def myself() -> UnitOwner:
    entry = pwd.getpwuid(os.geteuid())
    return UnitOwner(uid=entry.pw_uid, gid=entry.pw_gid, groups=tuple(os.getgroups()), name=entry.pw_name,
                     home=entry.pw_dir)


async def end_of_session(tmp_path: Path) -> None:
    config = ControllerConfig(state_dir=tmp_path / "state", unit_output_dir=str(tmp_path / "units" / "{job}"))
    store = StateStore(config.database_path)
    controller = Controller(config, store, ControllerMetrics())
    server = grpc.aio.server()
    launcher_pb2_grpc.add_LauncherServiceServicer_to_server(LauncherServicer(controller), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    resumed: asyncio.Task[None] | None = None
    try:
        actor, secret_path = await controller.submit(admin_pb2.JobSpec(
            name="ends", min_replicas=2, max_replicas=2, mode=common_pb2.JOB_MODE_LIVE, command=["true"]), myself())
        secret = secret_path.read_text().strip()
        # The job's loop, held back: nothing queued to it is handled until it runs again.
        loop_task = next(t for t in asyncio.all_tasks() if t.get_name() == f"job-{actor.job.job_id}")
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = launcher_pb2_grpc.LauncherServiceStub(channel).Session()
            await call.write(launcher_pb2.LauncherMessage(register=launcher_pb2.Register(
                job_id=actor.job.job_id, unit_id="u1", secret=secret, address="127.0.0.1", store_port=1)))
            first = await call.read()
            assert first.WhichOneof("body") == "registered"
            await call.write(launcher_pb2.LauncherMessage(leave_request=launcher_pb2.LeaveRequest(
                generation=0, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED, detail="the end of its time limit")))
            await call.done_writing()
            # The controller has read to the end, but its job has handled nothing: no end yet.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(call.read()), timeout=1.0)
            assert not any(e.kind in ("unit_registered", "unit_leaving", "unit_left")
                           for e in store.events(actor.job.job_id))
            # The job's loop runs again: the session ends cleanly, and what the launcher
            # said is in SQLite by then.
            resumed = asyncio.get_running_loop().create_task(actor.run())
            assert await asyncio.wait_for(call.read(), timeout=10) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            kinds = [e.kind for e in StateStore(config.database_path).events(actor.job.job_id)]
            assert "unit_registered" in kinds and ("unit_leaving" in kinds or "unit_left" in kinds), kinds
    finally:
        await server.stop(grace=None)
        for task in (resumed, *(t for t in asyncio.all_tasks() if t.get_name().startswith("job-"))):
            if task is not None:
                task.cancel()
        store.close()


def test_a_session_ends_cleanly_only_once_its_job_has_handled_what_the_launcher_said(tmp_path: Path) -> None:
    asyncio.run(end_of_session(tmp_path))
