"""What Tidal knows about Slurm: frozen dataclasses and enums, never raw dicts or strings.

Every backend (CLI JSON, pyslurm, the fake) returns these types, so the controller's logic
does not depend on which Slurm release or access path produced them.
"""

from __future__ import annotations

import enum
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime


class JobState(enum.StrEnum):
    """A Slurm job's base state (squeue's JOB_STATE without flags)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    TIMEOUT = "TIMEOUT"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    # Slurm 22.05 prints only a flag's name while a flag such as COMPLETING is set, so the
    # base state is not visible then.
    UNKNOWN = "UNKNOWN"

    @property
    def is_finished(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING, JobState.SUSPENDED, JobState.UNKNOWN)


class JobFlag(enum.StrEnum):
    """Flags Slurm sets beside a job's base state (JOB_STATE_FLAGS in slurm.h)."""

    COMPLETING = "COMPLETING"
    CONFIGURING = "CONFIGURING"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SIGNALING = "SIGNALING"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    LAUNCH_FAILED = "LAUNCH_FAILED"
    UPDATE_DB = "UPDATE_DB"
    REVOKED = "REVOKED"
    POWER_UP_NODE = "POWER_UP_NODE"
    RECONFIG_FAIL = "RECONFIG_FAIL"
    EXPEDITING = "EXPEDITING"


class NodeState(enum.StrEnum):
    """A node's base state (NODE_STATE_BASE in slurm.h)."""

    IDLE = "IDLE"
    MIXED = "MIXED"
    ALLOCATED = "ALLOCATED"
    DOWN = "DOWN"
    ERROR = "ERROR"
    FUTURE = "FUTURE"
    UNKNOWN = "UNKNOWN"


class NodeFlag(enum.StrEnum):
    """Flags beside a node's base state (NODE_STATE_FLAGS in slurm.h)."""

    DRAIN = "DRAIN"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    COMPLETING = "COMPLETING"
    RESERVED = "RESERVED"
    MAINTENANCE = "MAINTENANCE"
    PLANNED = "PLANNED"
    POWERED_DOWN = "POWERED_DOWN"
    POWERING_DOWN = "POWERING_DOWN"
    POWERING_UP = "POWERING_UP"
    POWER_DOWN = "POWER_DOWN"
    POWER_UP = "POWER_UP"
    POWER_DRAIN = "POWER_DRAIN"
    NOT_RESPONDING = "NOT_RESPONDING"
    REBOOT_REQUESTED = "REBOOT_REQUESTED"
    REBOOT_ISSUED = "REBOOT_ISSUED"
    REBOOT_CANCELED = "REBOOT_CANCELED"
    FAIL = "FAIL"
    INVALID = "INVALID"
    INVALID_REG = "INVALID_REG"
    CLOUD = "CLOUD"
    DYNAMIC_FUTURE = "DYNAMIC_FUTURE"
    DYNAMIC_NORM = "DYNAMIC_NORM"
    RESUME = "RESUME"
    UNDRAIN = "UNDRAIN"
    BLOCKED = "BLOCKED"
    EXTERNAL = "EXTERNAL"


#: Flags that make a node unfit to grow onto, whatever its base state.
BLOCKING_NODE_FLAGS = frozenset({
    NodeFlag.DRAIN, NodeFlag.DRAINING, NodeFlag.DRAINED, NodeFlag.COMPLETING,
    NodeFlag.RESERVED, NodeFlag.MAINTENANCE, NodeFlag.PLANNED, NodeFlag.POWERED_DOWN,
    NodeFlag.POWERING_DOWN, NodeFlag.POWERING_UP, NodeFlag.POWER_DOWN,
    NodeFlag.NOT_RESPONDING, NodeFlag.REBOOT_REQUESTED, NodeFlag.REBOOT_ISSUED,
    NodeFlag.FAIL, NodeFlag.INVALID, NodeFlag.INVALID_REG, NodeFlag.BLOCKED,
})


class PreemptMode(enum.StrEnum):
    OFF = "OFF"
    CANCEL = "CANCEL"
    REQUEUE = "REQUEUE"
    SUSPEND = "SUSPEND"
    GANG = "GANG"
    WITHIN = "WITHIN"
    PRIORITY = "PRIORITY"


@dataclass(frozen=True, order=True)
class SlurmVersion:
    major: int
    minor: int
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"


@dataclass(frozen=True)
class Gres:
    """One generic resource of a node, e.g. `gpu:a100:4` → Gres("gpu", "a100", 4)."""

    name: str
    type: str | None
    count: int


@dataclass(frozen=True)
class Node:
    name: str
    state: NodeState
    flags: frozenset[NodeFlag]
    partitions: tuple[str, ...]
    cpus: int
    gres: tuple[Gres, ...]
    features: tuple[str, ...]
    reason: str
    address: str = ""

    @property
    def is_idle_and_usable(self) -> bool:
        """Base state IDLE with no blocking flag: a place a new unit could start now.

        A hint only: Slurm decides placement when the unit is submitted."""
        return self.state is NodeState.IDLE and not (self.flags & BLOCKING_NODE_FLAGS)

    def gres_count(self, name: str) -> int:
        return sum(g.count for g in self.gres if g.name == name)


@dataclass(frozen=True)
class Job:
    job_id: int
    name: str
    user: str
    state: JobState
    flags: frozenset[JobFlag]
    partition: str
    nodes: tuple[str, ...]
    node_count: int
    priority: int
    submit_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    # Set when Slurm chose this job for preemption; the job has until end_time to leave.
    preempt_time: datetime | None
    # How often Slurm requeued the job (restart_cnt).
    requeue_count: int
    reason: str
    comment: str = ""

    @property
    def is_active(self) -> bool:
        """Pending, running or suspended: the job still holds or wants resources."""
        return not self.state.is_finished

    @property
    def is_being_preempted(self) -> bool:
        """Slurm chose the job for preemption and it has not left its nodes yet."""
        return self.preempt_time is not None and (
            self.state is JobState.RUNNING or JobFlag.COMPLETING in self.flags)

    @property
    def was_requeued(self) -> bool:
        return self.requeue_count > 0 or JobFlag.REQUEUED in self.flags


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[str, ...]
    priority_tier: int
    preempt_mode: frozenset[PreemptMode]
    grace_time_s: int
    is_default: bool
    is_up: bool


@dataclass(frozen=True)
class UnitOwner:
    """The Unix account a unit is submitted as: sbatch runs with its uid, gid and groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str
    home: str
    shell: str = "/bin/sh"

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run as this account by util-linux's setpriv (uid, gid, supplementary
        groups), not by Python's own `subprocess(user=...)`: changing ids in a child forked
        from the controller's many-threaded process crashed it (SIGSEGV) here."""
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", groups, "--", *argv]

    def environment(self) -> dict[str, str]:
        """What anything run as this account starts with: its identity and a plain PATH,
        never the controller's environment."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell or "/bin/sh",
                "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class UnitSubmission:
    """One unit (replica) to submit as a Slurm batch job.

    `environment` reaches the job through sbatch's own environment, never its argv, so a
    secret in it is not visible in `ps` or Slurm's record of the command line."""

    name: str
    script: str
    partition: str = ""
    nodes: int = 1
    exclusive: bool = True
    time_limit: str = ""
    exclude_nodes: tuple[str, ...] = ()
    constraint: str = ""
    gres: str = ""
    account: str = ""
    qos: str = ""
    working_dir: str = ""
    output: str = ""
    comment: str = ""
    requeue: bool = True
    extra_options: tuple[str, ...] = ()
    environment: Mapping[str, str] = field(default_factory=dict)
    # Submitted as this account (another user's job under a root controller): sbatch runs
    # with its ids and `--export=NONE`, and `environment` is set by the batch script itself.
    # None: as the controller's own user, with its environment (`--export=ALL`).
    owner: UnitOwner | None = None

    def owner_environment(self) -> dict[str, str]:
        """The whole environment a unit submitted for its owner starts with: the owner's
        identity, a plain PATH, then the unit's own variables."""
        assert self.owner is not None
        return {**self.owner.environment(), **self.environment}

    def script_for_owner(self) -> str:
        """The batch script with the owner environment set at its top (after `#!` and the
        `#SBATCH` lines): with `--export=NONE` nothing else reaches the job. Steps the script
        starts with `srun` inherit it (SLURM_EXPORT_ENV=ALL)."""
        lines = self.script.splitlines()
        at = 1 if lines and lines[0].startswith("#!") else 0
        while at < len(lines) and lines[at].startswith("#SBATCH"):
            at += 1
        exports = ["# The unit's environment (sbatch --export=NONE: nothing else of the submitter's)."]
        exports += [f"export {key}={shlex.quote(value)}" for key, value in self.owner_environment().items()]
        exports.append("export SLURM_EXPORT_ENV=ALL")
        return "\n".join([*lines[:at], *exports, *lines[at:]]) + "\n"
