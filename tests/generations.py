"""Tests' shorthand for the one world-change message (`Generation`): what a controller sent,
named by the kind of change it is, in the words the tests assert."""

from __future__ import annotations

from tidal.proto import launcher_pb2


def change_kind(generation: launcher_pb2.Generation) -> str:
    """'stop' (an empty generation, or naming the failed unit), 'leave' (leaving the job with
    no world to follow), 'reconfigure' (live mode's change at a step boundary) or 'start'
    (a generation sent to its members at once)."""
    if generation.failed_unit_id or (not generation.rank_table.assignments and not generation.leaving):
        return "stop"
    if generation.at_step_boundary:
        return "reconfigure"
    if generation.leaving and not generation.rank_table.assignments:
        return "leave"
    return "start"


def said(message: object) -> str:
    """A sent message as 'start:G', 'reconfigure:G:members', 'stop:G', 'leave', 'coming:G',
    or its oneof's name (or 'close') for anything else."""
    if not isinstance(message, launcher_pb2.ControllerMessage):
        return "close"
    if message.HasField("change_coming"):
        return f"coming:{message.change_coming.generation}"
    if not message.HasField("generation"):
        return message.WhichOneof("body") or ""
    generation = message.generation
    kind = change_kind(generation)
    if kind == "leave":
        return "leave"
    if kind == "reconfigure":
        return f"reconfigure:{generation.generation}:" + ",".join(a.unit_id for a in generation.rank_table.assignments)
    return f"{kind}:{generation.generation}"
