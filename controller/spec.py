"""Checking a submitted JobSpec: defaults filled in, every problem named by its field."""

from __future__ import annotations

import re

from tidal.proto import admin_pb2, common_pb2

# (Matched whole: `$` alone also matches before a final newline, which got a name ending
# in one through, and no unit of that job could register.)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class SpecError(ValueError):
    """The spec is invalid; the message names each offending field."""


def normalized_spec(spec: admin_pb2.JobSpec) -> admin_pb2.JobSpec:
    """A copy of `spec` with defaults filled in (min 1, max = min, one node and one
    process per replica, restart mode), or SpecError listing every problem."""
    result = admin_pb2.JobSpec()
    result.CopyFrom(spec)
    if result.min_replicas == 0:
        result.min_replicas = 1
    if result.max_replicas == 0:
        result.max_replicas = max(result.min_replicas, 1)
    if result.nodes_per_replica == 0:
        result.nodes_per_replica = 1
    if result.procs_per_node == 0:
        result.procs_per_node = 1
    if result.mode == common_pb2.JOB_MODE_UNSPECIFIED:
        result.mode = common_pb2.JOB_MODE_RESTART
    if not result.name:
        result.name = "job"
    problems: list[str] = []
    if not _NAME.fullmatch(result.name):
        problems.append(f"name: {result.name!r} must be 1-64 letters, digits, '.', '_' or '-'")
    if result.min_replicas < 1:
        problems.append(f"min_replicas: must be >= 1, got {result.min_replicas}")
    if result.max_replicas < result.min_replicas:
        problems.append(f"max_replicas: {result.max_replicas} is below min_replicas {result.min_replicas}")
    if result.nodes_per_replica < 1:
        problems.append(f"nodes_per_replica: must be >= 1, got {result.nodes_per_replica}")
    if not 1 <= result.procs_per_node <= 256:
        problems.append(f"procs_per_node: must be within 1..256, got {result.procs_per_node}")
    if result.global_batch < 0:
        problems.append(f"global_batch: must be positive (or 0: the script decides), got {result.global_batch}")
    if result.weight < 0:
        problems.append(f"weight: must be >= 1 (or 0: 1), got {result.weight}")
    if result.replica_step < 0:
        problems.append(f"replica_step: must be >= 0, got {result.replica_step}")
    if any(n < 1 for n in result.allowed_replicas):
        problems.append("allowed_replicas: every size must be >= 1")
    elif result.allowed_replicas and not any(
            result.min_replicas <= n <= result.max_replicas for n in result.allowed_replicas):
        problems.append("allowed_replicas: no size lies within min_replicas..max_replicas")
    if not result.command or not result.command[0]:
        problems.append("command: the training command is empty")
    if result.mode not in (common_pb2.JOB_MODE_LIVE, common_pb2.JOB_MODE_RESTART):
        problems.append(f"mode: unknown mode {result.mode}")
    if any(key.startswith("TIDAL_") for key in result.environment):
        problems.append("environment: TIDAL_* variables are Tidal's own")
    if any(not key or "=" in key or "\0" in key for key in result.environment):
        # (No process can have them: every worker's start failed.)
        problems.append("environment: a variable's name must be non-empty, without '=' or NUL")
    texts = {"command": list(result.command), "environment": list(result.environment.values()),
             "working_dir": [result.working_dir], "partition": [result.partition],
             "sbatch_options": list(result.sbatch_options)}
    problems += [f"{field}: NUL characters cannot be passed to a process" for field, values in texts.items()
                 if any("\0" in value for value in values)]
    if problems:
        raise SpecError("; ".join(problems))
    return result
