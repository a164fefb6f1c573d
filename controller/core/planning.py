"""Generation planning and world decisions: pure functions of a snapshot and `now`.

Each returns what to do and a human-readable reason; the job actor applies it and puts
the reason in the event log. Nothing here reads a clock, a socket or the database."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from tidal.controller.model import GenerationRecord, Member


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A unit that could be in the next generation."""

    unit_id: str
    nodes: tuple[str, ...]
    procs_per_node: int
    address: str
    # Port of the unit's fresh rendezvous store (0: unknown, cannot host).
    store_port: int
    # Group rank in the current generation, or None for a joiner.
    previous_group_rank: int | None
    registered_at: float
    # Its replica of several nodes and its node's place there (0: a replica of its own).
    replica: int = 0
    node_index: int = 0


def allowed_sizes(min_replicas: int, max_replicas: int, replica_step: int = 0,
                  allowed_replicas: Sequence[int] = ()) -> list[int]:
    """World sizes (in replicas) the job accepts, ascending. An explicit list wins; a step
    allows min, min+step, ...; otherwise every size from min to max."""
    if allowed_replicas:
        return sorted({n for n in allowed_replicas if min_replicas <= n <= max_replicas})
    step = replica_step if replica_step > 1 else 1
    return list(range(min_replicas, max_replicas + 1, step))


def choose_world_size(available: int, sizes: Sequence[int]) -> int | None:
    """The largest allowed size that `available` units can fill, or None."""
    fitting = [n for n in sizes if n <= available]
    return max(fitting) if fitting else None


def plan_generation(*, job_id: str, number: int, candidates: Sequence[Candidate], replicas: int, reason: str,
                    now: float, resume_step: int) -> GenerationRecord:
    """The next generation's rank table and rendezvous.

    Survivors keep their relative order (so ranks move as little as possible), joiners
    follow in registration order; the first `replicas` candidates (units) are members, the
    units of a replica of several nodes together, by node index. Group rank 0's replica
    hosts the rendezvous store; it is chosen among the live members each generation, so the
    loss of any one node, the previous host's included, never strands the job. A member
    whose store port is unknown is never made host."""
    if replicas <= 0 or replicas > len(candidates):
        raise ValueError(f"cannot form {replicas} replicas from {len(candidates)} candidates")

    def order(c: Candidate) -> tuple[bool, int, float, str]:
        return (c.previous_group_rank is None, c.previous_group_rank if c.previous_group_rank is not None else 0,
                c.registered_at, c.unit_id)

    # A replica of several nodes keeps its units together, by node index, so that its
    # workers take consecutive ranks in shard-rank order (a replica of one unit is its own).
    groups: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        key = f"replica/{candidate.replica}" if candidate.replica > 0 else f"unit/{candidate.unit_id}"
        groups.setdefault(key, []).append(candidate)
    ordered_groups = sorted((sorted(group, key=lambda c: c.node_index) for group in groups.values()),
                            key=lambda group: min(order(c) for c in group))
    chosen = [c for group in ordered_groups for c in group][:replicas]
    hosts = [c for c in chosen if c.store_port > 0]
    if not hosts:
        raise ValueError("no member can host the rendezvous store (no store port reported)")
    host = hosts[0]
    # The host's replica goes first, so that rank 0 and the store sit on the same node (on
    # the replica's first node when the host is another of its nodes).
    first = [c for c in chosen if (c.replica > 0 and c.replica == host.replica) or c is host]
    chosen = first + [c for c in chosen if c not in first]
    members: list[Member] = []
    first_rank = 0
    for group_rank, candidate in enumerate(chosen):
        member = Member(unit_id=candidate.unit_id, nodes=candidate.nodes, procs_per_node=candidate.procs_per_node,
                        group_rank=group_rank, first_rank=first_rank)
        members.append(member)
        first_rank += member.world_share
    return GenerationRecord(job_id=job_id, number=number, members=tuple(members), rendezvous_host=host.address,
                            rendezvous_port=host.store_port, rendezvous_unit_id=host.unit_id, reason=reason,
                            created_at=now, resume_step=resume_step)


@dataclasses.dataclass(frozen=True)
class WorldSnapshot:
    """What the world decision looks at."""

    running: bool
    members: tuple[str, ...]
    # Registered units not in the current generation, with when they registered (monotonic).
    joiners: Mapping[str, float]
    min_replicas: int
    max_replicas: int
    sizes: tuple[int, ...]
    # When the world last changed (monotonic), or None.
    last_change_at: float | None
    join_settle_s: float
    scale_up_snooze_s: float
    # Units submitted to Slurm that have not registered yet, less those queued ahead
    # (`queued_units`) that a Slurm view shows still waiting for a node, or None when
    # unknown (launchers started by hand): with none coming, there is nothing to settle for.
    expected: int | None = None
    # Of those, the ones a Slurm view showed started, with their Slurm start time (monotonic):
    # a world formed afresh waits `join_settle_s` from then for their launchers.
    starting: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # When the newest of those expected units was submitted (monotonic), or None: a grow
    # waits for it `join_settle_s` from then at most, as for a registration (forming does
    # not: survivors re-form at once while their replacement is submitted).
    expected_submitted_at: float | None = None
    # When a unit queued ahead in Slurm (`queued_units`) registered, if no Slurm view was
    # taken since (monotonic), else None. Slurm started it because a node freed; others may
    # have freed with it (a job of several nodes ended), which only the next view shows: a
    # grow waits for that view, `join_settle_s` at most, so that their units join in the
    # same world change rather than in a second one.
    unseen_start_at: float | None = None
    # Units per replica of the job's spec when the decision counts units (replicas of K
    # nodes decided node by node, DataParallel: min/max above are K × the spec's), else 1.
    # Only the reasons' words use it: they name nodes, and the spec's replica bounds.
    scale: int = 1


def counted(count: int, snapshot: WorldSnapshot) -> str:
    """`count` units in a reason's words: replicas, or nodes of replicas of K."""
    if snapshot.scale == 1:
        return f"{count} replica{'s' if count != 1 else ''}"
    return f"{count} node{'s' if count != 1 else ''}"


def bounds(snapshot: WorldSnapshot) -> str:
    """The job's min and max in a reason's words (the spec's replicas, with their nodes)."""
    if snapshot.scale == 1:
        return f"min {snapshot.min_replicas}, max {snapshot.max_replicas}"
    return (f"replicas of {snapshot.scale} nodes: min {snapshot.min_replicas // snapshot.scale}, "
            f"max {snapshot.max_replicas // snapshot.scale}")


@dataclasses.dataclass(frozen=True)
class Wait:
    reason: str


@dataclasses.dataclass(frozen=True)
class Form:
    """Form a new generation from the members that remain and these joiners."""

    replicas: int
    joiners: tuple[str, ...]
    reason: str


@dataclasses.dataclass(frozen=True)
class Grow:
    """Grow the running generation: the next one includes `joiners`."""

    replicas: int
    joiners: tuple[str, ...]
    reason: str


WorldAction = Wait | Form | Grow


def decide_world(snapshot: WorldSnapshot, now: float) -> WorldAction:
    """Form a world when none runs and enough units are ready, grow a running one onto
    joiners, or wait, saying why."""
    joiners = sorted(snapshot.joiners, key=lambda u: (snapshot.joiners[u], u))
    available = len(snapshot.members) + len(joiners)
    size = choose_world_size(min(available, snapshot.max_replicas), snapshot.sizes)
    settle_s = 0.0 if snapshot.expected == 0 else snapshot.join_settle_s
    settling_until = max(snapshot.joiners.values(), default=float("-inf")) + settle_s
    # A unit Slurm started registers in a moment: forming or growing without it would only
    # grow onto it right after (a world change while the workers still start).
    started_until = max(snapshot.starting.values(), default=float("-inf")) + snapshot.join_settle_s
    if not snapshot.running:
        if size is None:
            if snapshot.scale == 1:
                return Wait(f"{available} of min {snapshot.min_replicas} replicas ready")
            return Wait(f"{available} of {snapshot.min_replicas} nodes ready ({bounds(snapshot)})")
        settling_until = max(settling_until, started_until)
        if available < snapshot.max_replicas and now < settling_until:
            return Wait(f"{counted(available, snapshot)} ready; waiting {settling_until - now:.1f} s for more to "
                        "register")
        taken = tuple(joiners[: max(0, size - len(snapshot.members))])
        return Form(size, taken, f"{counted(size, snapshot)} ready ({bounds(snapshot)})")
    current = len(snapshot.members)
    if not joiners or current >= snapshot.max_replicas:
        return Wait("no joiner" if not joiners else f"at max_replicas {snapshot.max_replicas // snapshot.scale}")
    if size is None or size <= current:
        return Wait(f"{len(joiners)} joiner(s) do not reach the next allowed size above {current}")
    if snapshot.unseen_start_at is not None and now < snapshot.unseen_start_at + snapshot.join_settle_s:
        return Wait("a unit queued in Slurm started: waiting for a Slurm view of other nodes freed with its "
                    f"node ({snapshot.unseen_start_at + snapshot.join_settle_s - now:.1f} s at most)")
    # A grow also waits join_settle_s from the submission of a unit on its way (a view
    # just submitted it for a node that freed with a joiner's). (Forming does not: the
    # survivors of a failure re-form at once, while their replacement is submitted.)
    submitted_until = (snapshot.expected_submitted_at or float("-inf")) + settle_s
    settling_until = max(settling_until, started_until, submitted_until)
    if now < settling_until:
        return Wait(f"waiting {settling_until - now:.1f} s for more joiners to register")
    if snapshot.last_change_at is not None and now < snapshot.last_change_at + snapshot.scale_up_snooze_s:
        return Wait(f"scale-up snoozed for {snapshot.last_change_at + snapshot.scale_up_snooze_s - now:.1f} s")
    taken = tuple(joiners[: size - current])
    return Grow(size, taken, f"grow {current} -> {counted(size, snapshot)}: {', '.join(taken)} joined")


class BelowMin(enum.Enum):
    """What a live job below min_replicas does with the units it still holds."""

    HOLD = "hold"
    # Below min for the whole release wait.
    RELEASE = "release"
    # Sooner: nothing on its way for the blocked wait.
    RELEASE_BLOCKED = "release_blocked"
    # Released sooner only on a Slurm view taken after the blocked wait: ask for one.
    POLL = "poll"


def release_below_min(*, below_min_since: float | None, now: float, release_after_s: float, holding: int,
                      blocked_since: float | None = None, blocked_seen_at: float | None = None,
                      blocked_release_after_s: float = 0.0) -> BelowMin:
    """Whether a live job below min_replicas since `below_min_since` (its last registration
    included) gives back the `holding` units it still has (they train nothing until more
    nodes come): once it has been below min for `release_after_s` (0: never); or sooner,
    after `blocked_release_after_s` (0: not sooner), when every Slurm view from
    `blocked_since` to `blocked_seen_at` (the latest) showed nothing on its way (no idle
    node it could take, no unit of its starting) and that latest view was taken the
    blocked wait after both `blocked_since` and `below_min_since`. Past the wait with no
    such view yet: POLL (ask Slurm for a view now)."""
    if release_after_s <= 0 or below_min_since is None or holding <= 0:
        return BelowMin.HOLD
    if now - below_min_since >= release_after_s:
        return BelowMin.RELEASE
    if blocked_release_after_s <= 0 or blocked_since is None or blocked_seen_at is None:
        return BelowMin.HOLD
    due = max(blocked_since, below_min_since) + blocked_release_after_s
    if blocked_seen_at >= due:
        return BelowMin.RELEASE_BLOCKED
    return BelowMin.POLL if now >= due else BelowMin.HOLD
