"""The wire protocol: every world-changing message carries its generation, and the controller
changes a world by one message (`Generation`); stubs import as tidal.proto; garbage on the
wire is a decode error, not a crash elsewhere."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from tidal.proto import admin_pb2, admin_pb2_grpc, common_pb2, launcher_pb2, launcher_pb2_grpc


def test_package_and_services() -> None:
    assert launcher_pb2.DESCRIPTOR.package == "tidal.v1"
    assert launcher_pb2.DESCRIPTOR.services_by_name["LauncherService"].methods_by_name["Session"]
    admin_methods = set(admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name)
    assert {"SubmitJob", "GetJob", "ListJobs", "ListEvents", "WatchEvents", "ListNodes",
            "ResizeJob", "Drain", "CancelJob"} <= admin_methods
    assert hasattr(launcher_pb2_grpc, "LauncherServiceStub") and hasattr(admin_pb2_grpc, "AdminServiceStub")


@pytest.mark.parametrize("message", [
    launcher_pb2.Generation, launcher_pb2.WorkerExited, launcher_pb2.LeaveRequest, launcher_pb2.GenerationReport,
    launcher_pb2.ChangeComing,
])
def test_world_messages_carry_the_generation(message: type) -> None:
    assert "generation" in message.DESCRIPTOR.fields_by_name


def test_the_controller_changes_a_world_by_one_message() -> None:
    # `change_coming` changes nothing: it says that a `generation` follows (an optimization).
    body = launcher_pb2.ControllerMessage.DESCRIPTOR.oneofs_by_name["body"]
    assert [field.name for field in body.fields] == ["registered", "generation", "change_coming"]


def test_round_trip_of_a_generation() -> None:
    table = common_pb2.RankTable(world_size=4, assignments=[
        common_pb2.RankAssignment(unit_id="u1", nodes=["n1"], group_rank=0, first_rank=0, procs_per_node=2),
        common_pb2.RankAssignment(unit_id="u2", nodes=["n2"], group_rank=1, first_rank=2, procs_per_node=2)])
    command = launcher_pb2.ControllerMessage(generation=launcher_pb2.Generation(
        generation=3, from_generation=2, target_step=120, rank_table=table,
        rendezvous=common_pb2.Rendezvous(host="127.0.0.1", port=29500, host_unit_id="u2"),
        reason="grow", failed_unit_id="u3", leaving=["u4"], save_state=True, at_step_boundary=True))
    command.generation.stop_grace.FromSeconds(5)
    decoded = launcher_pb2.ControllerMessage.FromString(command.SerializeToString())
    assert decoded.WhichOneof("body") == "generation" and decoded == command
    assert list(decoded.generation.leaving) == ["u4"] and decoded.generation.at_step_boundary


def test_garbled_bytes_are_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        launcher_pb2.LauncherMessage.FromString(b"\xff\xff\xff\xff\x0f garbage")
