"""A launcher's session ends cleanly only once the controller's job has handled what the
launcher said in it: a launcher takes that clean end as proof that its end-of-training
reports are safe (`ControllerLink.hold_written`). The controller's own servicer, job actor
and SQLite file, over real gRPC on loopback; the actor's loop is held back to stand for a
busy controller (or one killed before it got to the messages)."""

from __future__ import annotations

import asyncio
import os
import pwd
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tidal.controller import server as server_module
from tidal.controller.config import ControllerConfig
from tidal.controller.jobs import JobActor
from tidal.controller.metrics import ControllerMetrics
from tidal.controller.security import secret_matches
from tidal.controller.server import Controller, LauncherServicer
from tidal.controller.store import StateStore
from tidal.proto import admin_pb2, common_pb2, launcher_pb2, launcher_pb2_grpc
from tidal.slurm.models import UnitOwner

LEAVE = launcher_pb2.LauncherMessage(leave_request=launcher_pb2.LeaveRequest(
    generation=0, cause=launcher_pb2.LEAVE_CAUSE_PREEMPTED, detail="the end of its time limit"))


def myself() -> UnitOwner:
    entry = pwd.getpwuid(os.geteuid())
    return UnitOwner(uid=entry.pw_uid, gid=entry.pw_gid, groups=tuple(os.getgroups()), name=entry.pw_name,
                     home=entry.pw_dir)


@dataclass
class Served:
    actor: JobActor
    secret: str
    port: int
    database: Path
    controller: Controller


@asynccontextmanager
async def served_job(tmp_path: Path) -> AsyncIterator[Served]:
    """A controller with one live job (min 2, so no world forms), its launcher service on a
    loopback port."""
    config = ControllerConfig(state_dir=tmp_path / "state", unit_output_dir=str(tmp_path / "units" / "{job}"))
    store = StateStore(config.database_path)
    controller = Controller(config, store, ControllerMetrics())
    server = grpc.aio.server()
    launcher_pb2_grpc.add_LauncherServiceServicer_to_server(LauncherServicer(controller), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        actor, secret_path = await controller.submit(admin_pb2.JobSpec(
            name="ends", min_replicas=2, max_replicas=2, mode=common_pb2.JOB_MODE_LIVE, command=["true"]), myself())
        yield Served(actor, secret_path.read_text().strip(), port, config.database_path, controller)
    finally:
        await server.stop(grace=None)
        for task in asyncio.all_tasks():
            if task.get_name().startswith("job-"):
                task.cancel()
        store.close()


async def open_session(served: Served, channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    call = launcher_pb2_grpc.LauncherServiceStub(channel).Session()
    await call.write(launcher_pb2.LauncherMessage(register=launcher_pb2.Register(
        job_id=served.actor.job.job_id, unit_id="u1", secret=served.secret, address="127.0.0.1", store_port=1)))
    assert (await call.read()).WhichOneof("body") == "registered"
    return call


def unit_event_kinds(served: Served) -> list[str]:
    store = StateStore(served.database)
    try:
        return [e.kind for e in store.events(served.actor.job.job_id) if e.kind.startswith("unit_")]
    finally:
        store.close()


async def held_back_loop(tmp_path: Path) -> None:
    async with served_job(tmp_path) as served:
        # The job's loop, held back: nothing queued to it is handled until it runs again.
        loop_task = next(t for t in asyncio.all_tasks() if t.get_name() == f"job-{served.actor.job.job_id}")
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            call = await open_session(served, channel)
            await call.write(LEAVE)
            await call.done_writing()
            # The controller has read to the end, but its job has handled nothing: no end yet.
            end = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait({end}, timeout=1.0)
            assert not done, "the session ended before its job handled what the launcher said"
            assert unit_event_kinds(served) == []
            # The job's loop runs again (named as the controller names it, so that the
            # context's clean-up stops it): the session ends cleanly, and what the
            # launcher said is in SQLite by then.
            asyncio.get_running_loop().create_task(served.actor.run(), name=f"job-{served.actor.job.job_id}")
            message = await asyncio.wait_for(end, timeout=10)
            while message is not grpc.aio.EOF:  # the job's answers (its leave ordered) come first
                message = await asyncio.wait_for(call.read(), timeout=10)
            assert await call.code() == grpc.StatusCode.OK
            kinds = unit_event_kinds(served)
            assert "unit_registered" in kinds and ("unit_leaving" in kinds or "unit_left" in kinds), kinds


async def refused_write(tmp_path: Path) -> None:
    async with served_job(tmp_path) as served, grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        call = await open_session(served, channel)
        persist = served.actor._persist

        def refuse(effects: object) -> None:
            raise sqlite3.OperationalError("database or disk is full")

        served.actor._persist = refuse  # type: ignore[method-assign]
        try:
            await call.write(LEAVE)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as broken:
                await asyncio.wait_for(call.read(), timeout=10)
        finally:
            served.actor._persist = persist  # type: ignore[method-assign]
        assert broken.value.code() == grpc.StatusCode.UNAVAILABLE, broken.value
        assert "send it again" in (broken.value.details() or "")
        assert "unit_leaving" not in unit_event_kinds(served)


def test_a_session_ends_cleanly_only_once_its_job_has_handled_what_the_launcher_said(tmp_path: Path) -> None:
    asyncio.run(held_back_loop(tmp_path))


def test_a_message_the_job_could_not_write_breaks_the_session_so_that_the_launcher_sends_it_again(
        tmp_path: Path) -> None:
    asyncio.run(refused_write(tmp_path))


def test_a_drawn_job_id_equal_to_a_jobs_is_drawn_again_and_that_jobs_secret_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job ids are the name and 3 random bytes. A second job that drew the first's id
    overwrote its secret file before SQLite refused the insert: the first job's launchers
    were refused from then on, and the submission failed with an internal error."""
    draws = iter(["aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(server_module.secrets, "token_hex", lambda _: next(draws))

    async def scenario() -> None:
        async with served_job(tmp_path) as served:
            assert served.actor.job.job_id == "ends-aaaaaa"
            again, path = await served.controller.submit(admin_pb2.JobSpec(
                name="ends", min_replicas=2, max_replicas=2, mode=common_pb2.JOB_MODE_LIVE, command=["true"]),
                myself())
            assert again.job.job_id == "ends-bbbbbb"
            first_path = path.with_name(path.name.replace("ends-bbbbbb", "ends-aaaaaa"))
            assert secret_matches(first_path.read_text().strip(), served.actor.job.secret_sha256)

    asyncio.run(scenario())
