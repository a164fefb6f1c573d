"""Typed errors from the Slurm access layer. A failed call raises; it never returns
"nothing changed"."""

from __future__ import annotations

from collections.abc import Sequence


class SlurmError(Exception):
    """Base class: Slurm could not be asked, or did not answer usefully."""


class SlurmNotInstalled(SlurmError):
    def __init__(self, program: str) -> None:
        super().__init__(f"{program}: not found on PATH (is slurm-client installed?)")
        self.program = program


class SlurmTimeout(SlurmError):
    def __init__(self, command: Sequence[str], timeout_s: float) -> None:
        super().__init__(f"{' '.join(command)}: no answer within {timeout_s:g}s")
        self.command = tuple(command)
        self.timeout_s = timeout_s


class SlurmCommandFailed(SlurmError):
    def __init__(self, command: Sequence[str], returncode: int, stderr: str) -> None:
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
        super().__init__(f"{' '.join(command)}: exit {returncode}: {detail}")
        self.command = tuple(command)
        self.returncode = returncode
        self.stderr = stderr


class SlurmParseError(SlurmError):
    """Slurm answered, but not with what this version of its output should look like."""


class SlurmReportedError(SlurmError):
    """Slurm's command exited 0 but its JSON lists errors: Slurm 22.05's `squeue --json`
    answers an unreachable slurmctld with `"jobs": []` and an error, which must never
    read as "no jobs"."""


# What Slurm's commands print when slurmctld gave no answer (down, overloaded, a network
# fault), whatever the command asked: an exit 1 that is no refusal.
_NO_SLURMCTLD = ("Unable to contact slurm controller", "Socket timed out on send/recv operation",
                 "Zero Bytes were transmitted or received")


def slurmctld_unanswered(error: SlurmError) -> bool:
    """Whether a command failed for want of an answer (it could not be run, timed out, or
    slurmctld could not be reached or timed out) rather than by Slurm's refusal: asked
    again later, it may well be carried out."""
    if isinstance(error, SlurmCommandFailed):
        return error.returncode < 0 or any(words in error.stderr for words in _NO_SLURMCTLD)
    return isinstance(error, SlurmTimeout | SlurmNotInstalled)


def answer_lost(error: SlurmError) -> bool:
    """Whether a submission that raised `error` may have been carried out all the same:
    sbatch timed out, printed no job id, or lost slurmctld after sending the job ('Socket
    timed out on send/recv operation', which an overloaded slurmctld answers to jobs it
    took: nextflow-io/nextflow#970). Only Slurm's queue can say whether the job exists."""
    return isinstance(error, SlurmTimeout | SlurmParseError) or (
        isinstance(error, SlurmCommandFailed) and "Socket timed out" in error.stderr)


class SlurmJobNotFound(SlurmError):
    def __init__(self, job_id: int) -> None:
        super().__init__(f"Slurm job {job_id} is unknown (never existed, or left squeue after MinJobAge)")
        self.job_id = job_id


class UnsupportedSlurmVersion(SlurmError):
    pass
