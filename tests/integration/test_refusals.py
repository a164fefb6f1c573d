"""Bad launchers and bad admins are refused with a clear gRPC status; the controller stays
up and the running job is untouched. Also: a joiner grows the world (restart mode)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import ControllerProcess, TidalRun, alive
from tidal.controller.client import AdminClient
from tidal.proto import admin_pb2, launcher_pb2

pytestmark = pytest.mark.integration

SESSION = "/tidal.v1.LauncherService/Session"


def session_status(address: str, messages: list[launcher_pb2.LauncherMessage | bytes],
                   keep_reading: bool = False) -> tuple[grpc.StatusCode, str]:
    """Open a session, send `messages` (bytes go out raw), read until the controller ends
    it; the final status."""
    def requests() -> Iterator[bytes]:
        for message in messages:
            yield message if isinstance(message, bytes) else message.SerializeToString()

    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        call = channel.stream_stream(SESSION, request_serializer=lambda b: b,
                                     response_deserializer=launcher_pb2.ControllerMessage.FromString)
        try:
            for _ in call(requests(), timeout=10):
                pass
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def register(run: TidalRun, unit: str, *, secret: str | None = None, last_generation: int = 0,
             address: str = "127.0.0.1") -> launcher_pb2.LauncherMessage:
    real = Path(run.secret_path).read_text().strip()
    return launcher_pb2.LauncherMessage(register=launcher_pb2.Register(
        job_id=run.job_id, unit_id=unit, secret=real if secret is None else secret, address=address,
        last_generation=last_generation, store_port=1))


def test_bad_launchers_are_refused_and_the_job_is_untouched(tidal_run: TidalRun) -> None:
    tidal_run.submit(min_replicas=2, max_replicas=3)
    tidal_run.start_launcher("u1")
    tidal_run.start_launcher("u2")
    tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 1)
    tidal_run.wait_steps(3, world_size=2)
    # A third launcher joins: restart mode stops generation 1 and forms generation 2 with three.
    tidal_run.start_launcher("u3")
    grown = tidal_run.controller.wait_event(tidal_run.job_id, "world_formed", where=lambda e: e.generation == 2)
    assert grown.fields["world_size"] == "3" and grown.reason.startswith("grow 2 -> 3")
    tidal_run.wait_steps(3, world_size=3)
    workers = tidal_run.all_worker_pids()
    running = {pid for pid in workers if alive(pid)}
    assert len(running) == 3
    address = tidal_run.controller.address
    events_before = len(tidal_run.controller.events(tidal_run.job_id))

    code, details = session_status(address, [register(tidal_run, "intruder", secret="not-the-secret")])
    assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong secret" in details
    code, details = session_status(address, [register(tidal_run, "ghost", last_generation=1)])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale generation 1" in details
    code, details = session_status(address, [register(tidal_run, "u1", last_generation=9)])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "claims generation 9" in details
    code, details = session_status(address, [b"\xff\xfe garbled, not a protobuf \x00\x01"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "garbled" in details, (code, details)
    code, details = session_status(address, [register(tidal_run, "big", address="x" * (2 << 20))])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    code, details = session_status(address, [launcher_pb2.LauncherMessage(
        heartbeat=launcher_pb2.Heartbeat(sequence=2))])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "first message must be register" in details
    unknown = launcher_pb2.LauncherMessage()
    unknown.CopyFrom(register(tidal_run, "lost"))
    unknown.register.job_id = "no-such-job"
    code, details = session_status(address, [unknown])
    assert code == grpc.StatusCode.NOT_FOUND
    flood = [register(tidal_run, "flood")] + [
        launcher_pb2.LauncherMessage(heartbeat=launcher_pb2.Heartbeat(sequence=i)) for i in range(500)]
    code, details = session_status(address, flood)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "messages/s" in details

    # The controller serves, and the job ran on untouched.
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    job = tidal_run.job()
    assert job.state == admin_pb2.JOB_STATE_RUNNING and job.generation == 2 and job.world_size == 3
    assert all(alive(pid) for pid in running) and tidal_run.all_worker_pids() == workers
    kinds = [e.kind for e in tidal_run.controller.events(tidal_run.job_id)[events_before:]]
    assert "failure_detected" not in kinds and "generation_stopping" not in kinds


def test_admin_calls_are_checked_by_uid_and_token(tidal_run: TidalRun) -> None:
    job = tidal_run.submit(min_replicas=1, max_replicas=1)
    assert job.owner_uid == 0 and Path(tidal_run.secret_path).stat().st_mode & 0o777 == 0o600
    address = tidal_run.controller.address
    token = (tidal_run.controller.state_dir / "admin.token").read_text().strip()
    with AdminClient(address=address) as anonymous, pytest.raises(grpc.RpcError) as refused:
        anonymous.jobs()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with AdminClient(address=address, token="wrong") as wrong, pytest.raises(grpc.RpcError) as refused:
        wrong.jobs()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with AdminClient(address=address, token=token) as admin:
        assert [j.job_id for j in admin.jobs()] == [tidal_run.job_id]
    with tidal_run.controller.admin() as client, pytest.raises(grpc.RpcError) as refused:
        client.submit(admin_pb2.JobSpec(name="bad", min_replicas=3, max_replicas=2, command=["true"]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_replicas: 2 is below min_replicas 3" in (refused.value.details() or "")
    # A resize is checked as a submission is: bounds that leave no allowed size are refused.
    with tidal_run.controller.admin() as client:
        sized = client.submit(admin_pb2.JobSpec(name="sized", min_replicas=4, max_replicas=8, allowed_replicas=[4, 8],
                                                command=["true"])).job
        with pytest.raises(grpc.RpcError) as refused:
            client.resize(sized.job_id, 3, 3)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "allowed_replicas: no size lies within" in (refused.value.details() or "")
        assert client.resize(sized.job_id, 4, 4).spec.max_replicas == 4
        client.cancel(sized.job_id)

    # Another user, over the Unix socket: may not touch root's job. The probe imports as
    # root, then drops to uid 65534 before it connects; the kernel reports that uid.
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    probe = (
        "import grpc, os, sys\n"
        "from pathlib import Path\n"
        "from tidal.controller.client import AdminClient\n"
        "os.setgid(65534); os.setuid(65534)\n"
        f"client = AdminClient(unix_socket=Path({str(tidal_run.controller.socket)!r}))\n"
        "try:\n"
        f"    client.cancel({tidal_run.job_id!r})\n"
        "except grpc.RpcError as error:\n"
        "    print(error.code().name, error.details())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert result.stdout.startswith("PERMISSION_DENIED"), result.stdout + result.stderr
    assert "belongs to uid 0, not to uid 65534" in result.stdout
    assert tidal_run.job().state != admin_pb2.JOB_STATE_CANCELLED


def test_roots_jobs_are_refused_unless_the_config_allows_them(tmp_path: Path) -> None:
    """The shared service's default: training runs as the user it belongs to, never as
    root; the refusal says how an admin would allow it, and nothing is kept."""
    if os.geteuid() != 0:
        pytest.skip("the caller must be root")
    controller = ControllerProcess(tmp_path, {"allow_root_jobs": "false"})
    controller.start()
    try:
        with controller.admin() as admin, pytest.raises(grpc.RpcError) as refused:
            admin.submit(admin_pb2.JobSpec(name="as-root", min_replicas=1, max_replicas=1, command=["true"]))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "jobs of root are refused" in (refused.value.details() or "")
        assert "allow_root_jobs = true" in (refused.value.details() or "")
        with controller.admin() as admin:
            assert admin.jobs(include_finished=True) == []
            # An admin names the user a job runs as; an unknown name is a clear error.
            with pytest.raises(grpc.RpcError) as unknown:
                admin.submit(admin_pb2.JobSpec(name="x", min_replicas=1, max_replicas=1, command=["true"]),
                             owner="no-such-user-here")
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no account named 'no-such-user-here'" in (unknown.value.details() or "")
    finally:
        controller.stop()


def test_a_second_controller_on_the_same_state_is_refused_and_the_first_serves_on(tmp_path: Path) -> None:
    """A second tidal-controller started on a state file that one already uses (by hand
    beside the service, say, on another port) opened it, took the first one's Unix socket
    for itself where it was the same path, and both then decided for the same jobs. It exits at start, naming the
    first one; the first keeps its socket and its jobs."""
    first = ControllerProcess(tmp_path, {})
    first.start()
    second = None
    try:
        with first.admin() as admin:
            job_id = admin.submit(admin_pb2.JobSpec(name="one", command=["true"])).job.job_id
        # The same state folder; its own port and socket.
        second_socket = first.socket_dir / "second.sock"
        second = subprocess.Popen(
            [sys.executable, "-m", "tidal.controller.daemon", "--state-dir", str(first.state_dir),
             "--listen", "127.0.0.1:0", "--unix-socket", str(second_socket), "--metrics-listen", "",
             "--set", "allow_root_jobs=true"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the second controller is serving the first one's state")
        assert second.returncode == 1, output
        assert b"controller_start_failed" in output and f"pid {first.ready['pid']}".encode() in output, output
        assert not second_socket.exists()
        with first.admin() as admin:
            assert [j.job_id for j in admin.jobs()] == [job_id]
    finally:
        if second is not None and second.poll() is None:
            second.kill()
            second.wait(10)
        first.stop()
