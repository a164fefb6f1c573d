"""The controller's pure core: decisions as functions of a job's state and `now`.

Nothing here reads a clock, touches SQLite, sends a message or awaits: the job actor
(`controller/jobs.py`) gathers what it observed, asks the core, and applies the answer
in one place (persist, then send). Today the core holds the job's progress watermark and
the state holders of a generation (`progress`) and the end of a finishing job
(`completion`); world planning (`controller/planning.py`) and health verdicts
(`controller/health.py`) are pure too and move here next."""

from tidal.controller.core.completion import Completed, FinishingMember, completion_verdict
from tidal.controller.core.progress import MemberProgress, committed_step, state_holders

__all__ = ["Completed", "FinishingMember", "MemberProgress", "committed_step", "completion_verdict",
           "state_holders"]
