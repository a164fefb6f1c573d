"""The controller's pure core: decisions as functions of a job's state and `now`.

Nothing here reads a clock, touches SQLite, sends a message or awaits: the job actor
(`controller/jobs.py`) gathers what it observed, asks the core, and applies the answer in
one place (persist, then send). `job` is one job's state machine, `transition(state,
input, now) -> (state, effects)`; it uses world planning (`planning`), health verdicts
(`health`), the job's progress watermark and a generation's state holders (`progress`),
the end of a finishing job (`completion`) and the cluster-wide shares (`sharing`). `job`
is imported as `tidal.controller.core.job`, not from here: it needs the unit rules of
`tidal.controller.units`, which need `planning`."""

from tidal.controller.core.completion import Completed, FinishingMember, completion_verdict
from tidal.controller.core.progress import MemberProgress, committed_step, state_holders

__all__ = ["Completed", "FinishingMember", "MemberProgress", "committed_step", "completion_verdict",
           "state_holders"]
