"""The one world-change message (`Generation`, proto/launcher.proto), as each change fills it.
Every change of a job's world is the next generation with its member table; what a launcher
does follows from where the message puts it: a member of the new generation, leaving, named
failed, or (an empty table) stopped with the generation it was in."""

from __future__ import annotations

from collections.abc import Iterable

from tidal.controller.core.queries import duration
from tidal.controller.model import GenerationRecord
from tidal.proto import launcher_pb2


def member(generation: GenerationRecord, unit_id: str, stop_grace_s: float | None = None,
           reason: str = "") -> launcher_pb2.ControllerMessage:
    """`generation` to one of its members, at once (a form, restart mode's change, a
    failure's next generation): only the member's own assignment; `stop_grace_s` for the
    workers of an older generation it replaces."""
    return members(generation, (unit_id,), stop_grace_s, reason)[0][1]


def members(generation: GenerationRecord, unit_ids: Iterable[str], stop_grace_s: float | None = None,
            reason: str = "") -> list[tuple[str, launcher_pb2.ControllerMessage]]:
    """`member`'s message to each of `unit_ids`: what they share is built once and copied,
    then each gets its own assignment (a failure's next generation to 2,000 members)."""
    shared = launcher_pb2.Generation(generation=generation.number, rendezvous=generation.rendezvous(),
                                     target_step=generation.resume_step, reason=reason)
    shared.rank_table.SetInParent()
    shared.rank_table.world_size = generation.world_size
    shared.rank_table.groups = len(generation.members)
    if stop_grace_s is not None:
        shared.stop_grace.CopyFrom(duration(stop_grace_s))
    sent = []
    for unit_id in unit_ids:
        message = launcher_pb2.ControllerMessage()
        message.generation.CopyFrom(shared)
        found = generation.member(unit_id)
        if found is not None:
            message.generation.rank_table.assignments.add(
                unit_id=found.unit_id, nodes=found.nodes, group_rank=found.group_rank, first_rank=found.first_rank,
                procs_per_node=found.procs_per_node)
        sent.append((unit_id, message))
    return sent


def at_step_boundary(generation: GenerationRecord, from_generation: int, leaving: Iterable[str],
                     reason: str) -> launcher_pb2.ControllerMessage:
    """Live mode: the world moves from `from_generation` to `generation` at a step boundary
    its ranks agree on; the whole member table (the workers find who leaves by its absence)."""
    return launcher_pb2.ControllerMessage(generation=launcher_pb2.Generation(
        generation=generation.number, from_generation=from_generation, rank_table=generation.rank_table(),
        rendezvous=generation.rendezvous(), target_step=generation.resume_step, leaving=sorted(leaving),
        reason=reason, at_step_boundary=True))


def change_coming(generation: int) -> launcher_pb2.ControllerMessage:
    """Live mode: to the old world's members while `generation`'s joiners start: its world
    follows, and their workers vote at each step's end meanwhile (`ChangeComing`)."""
    return launcher_pb2.ControllerMessage(change_coming=launcher_pb2.ChangeComing(generation=generation))


def stop(generation: int, reason: str, grace_s: float, failed_unit_id: str = "") -> launcher_pb2.ControllerMessage:
    """An empty generation: the stop of `generation` (naming `failed_unit_id` to the unit the
    controller declared failed). It takes no number of its own."""
    message = launcher_pb2.Generation(generation=generation, from_generation=generation, reason=reason,
                                      failed_unit_id=failed_unit_id)
    message.stop_grace.CopyFrom(duration(grace_s))
    return launcher_pb2.ControllerMessage(generation=message)


def leave(generation: int, unit_id: str, reason: str, save_state: bool = False) -> launcher_pb2.ControllerMessage:
    """`unit_id` leaves the job from `generation` (no world follows on it: the job's end, a
    unit on standby, a leave the world cannot follow in-process); with `save_state`, its
    live workers first write the job's state, of which it holds the last copy."""
    return launcher_pb2.ControllerMessage(generation=launcher_pb2.Generation(
        generation=generation, from_generation=generation, leaving=[unit_id], reason=reason, save_state=save_state))
