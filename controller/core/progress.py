"""The job's progress watermark and who holds the training state.

A step commits collectively: a rank has committed step k only once the gradient
all-reduce of step k completed, which every rank of the generation joined. So the lowest
step that every rank of a generation reports is a step every living rank holds, and the
job's committed step (its watermark) is the highest such step seen. It never goes down,
except when the workers say they resumed from an older checkpoint (the actor applies
that). A generation's target step is the watermark when it is decided; its state holders
are the units whose every worker reports that step or later."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class MemberProgress:
    """What one member of the training world last reported: `ranks` is how many ranks it
    runs in the generation; `steps` maps each reporting rank to its committed steps."""

    unit_id: str
    ranks: int
    steps: Mapping[int, int]


def committed_step(previous: int, members: Sequence[MemberProgress]) -> int:
    """The job's committed step after these reports: the lowest step over every rank of
    the generation, once every rank has reported one, and never below `previous`."""
    if not members or any(len(member.steps) < member.ranks for member in members):
        return previous
    lowest = min(step for member in members for step in member.steps.values())
    return max(previous, lowest)


def state_holders(target_step: int, unit_steps: Mapping[str, Sequence[int]]) -> tuple[str, ...]:
    """Units whose workers all hold the training state at `target_step` or later, sorted.
    At step 0 nobody needs to hold anything (a first generation starts from the seed), so
    the answer is empty there; a unit with no worker reporting holds nothing."""
    if target_step <= 0:
        return ()
    return tuple(sorted(unit_id for unit_id, steps in unit_steps.items()
                        if steps and min(steps) >= target_step))
