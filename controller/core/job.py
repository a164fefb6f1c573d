"""One job's state machine: `transition(state, input, now) -> (state, effects)`.

Every decision about a job is taken in this package: forming a generation, growing it, a
unit's leave, a failure, the end of training and the job's completion, what a Slurm view
means for the job's units, and node cool-downs. Nothing here reads a clock, touches SQLite,
sends a message or awaits; `transition` never changes the state it is given (it works on a
copy and returns it). The job actor (`controller/jobs.py`) feeds it inputs and applies the
effects it returns in one place: the persistent ones in one SQLite transaction first, then
the rest (messages, session closes, Slurm cancels and submissions, metrics) in order.

Where each thing lives (a file is one concern):

| file | what |
| --- | --- |
| `state.py` | `State`, the inputs, the effects, `restore` after a controller restart |
| `step.py` | `Step`: one transition in the making (the working copy, the clock, the effects) |
| `inputs.py` | what each input means; the one place inputs are taken apart |
| `tick.py` | each clock tick: deadlines, health verdicts, the committed step, form or grow |
| `forming.py` | planning and sending a generation; live mode's in-process change |
| `leaving.py` | a unit asked to leave; deferred leaves; saving the last copy of the state |
| `failure.py` | the one failure path; the next generation from the survivors, or the stop (an empty generation) first |
| `finishing.py` | the last step, completion once, and the end of a job |
| `messages.py` | the one world-change message (`Generation`), as each kind of change fills it |
| `slurm_units.py` | units as Slurm jobs: views, submissions, growth, cool-downs |
| `queries.py` | pure reads of a state for the gRPC layer and the cluster-wide plans |

This module is the state machine's public face: `transition`, and the names its callers use.

Times: `Now.monotonic` for deadlines and ages, `Now.wall` for what is recorded."""

from __future__ import annotations

from tidal.controller.core import inputs, slurm_units
from tidal.controller.core.queries import (
    MAX_WORKER_ERROR_CHARS,
    MAX_WORKER_TRACEBACK_CHARS,
    alive_units,
    describe_exit,
    describe_worker_exit,
    duration,
    growing_job,
    refusal,
    worker_error_fields,
    world_size,
    yielding_job,
)
from tidal.controller.core.state import (
    PERSISTENT,
    CancelFailed,
    CancelInSlurm,
    CancelRequested,
    ChangeKind,
    ClockTick,
    Close,
    DrainRequested,
    Effect,
    FailureCounted,
    GenerationCounted,
    GenerationStopped,
    InFlight,
    Input,
    LauncherClosed,
    LauncherConnected,
    LauncherSaid,
    Link,
    Metric,
    Note,
    Now,
    Persist,
    PollSlurmSoon,
    Record,
    Recovery,
    RecoveryTimed,
    ResizeRequested,
    SaveGeneration,
    SaveJob,
    SavePending,
    SaveUnit,
    Send,
    SlurmObserved,
    StaleMessageCounted,
    State,
    StopTimed,
    Submit,
    UnitSubmitted,
    restore,
    working_copy,
)
from tidal.controller.core.step import Step


def transition(state: State, event: Input, now: Now) -> tuple[State, list[Effect]]:
    """The job's next state after `event` at `now`, and what to do about it. `state` is
    left as it was."""
    step = Step(working_copy(state), now)
    inputs.handle(step, event)
    if not isinstance(event, SlurmObserved):
        slurm_units.poll_after_units_ended(step, state)
    return step.state, step.effects


__all__ = [
    "MAX_WORKER_ERROR_CHARS",
    "MAX_WORKER_TRACEBACK_CHARS",
    "PERSISTENT",
    "CancelFailed",
    "CancelInSlurm",
    "CancelRequested",
    "ChangeKind",
    "ClockTick",
    "Close",
    "DrainRequested",
    "Effect",
    "FailureCounted",
    "GenerationCounted",
    "GenerationStopped",
    "InFlight",
    "Input",
    "LauncherClosed",
    "LauncherConnected",
    "LauncherSaid",
    "Link",
    "Metric",
    "Note",
    "Now",
    "Persist",
    "PollSlurmSoon",
    "Record",
    "Recovery",
    "RecoveryTimed",
    "ResizeRequested",
    "SaveGeneration",
    "SaveJob",
    "SavePending",
    "SaveUnit",
    "Send",
    "SlurmObserved",
    "StaleMessageCounted",
    "State",
    "StopTimed",
    "Submit",
    "UnitSubmitted",
    "alive_units",
    "describe_exit",
    "describe_worker_exit",
    "duration",
    "growing_job",
    "refusal",
    "restore",
    "transition",
    "worker_error_fields",
    "world_size",
    "yielding_job",
]
