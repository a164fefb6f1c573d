"""The default backend: Slurm's own commands with --json, each call under a timeout.

Reads use `squeue --json` for jobs, `sinfo --json` (22.05) or `scontrol show nodes --json`
(23.11+) for nodes, and `scontrol show partition --oneliner` for partitions. Slurm 22.05
ignores filters given together with --json, so every filter is applied here, after one
cluster-wide query.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from tidal.slurm import parse
from tidal.slurm.errors import (
    SlurmCommandFailed,
    SlurmJobNotFound,
    SlurmNotInstalled,
    SlurmTimeout,
    UnsupportedSlurmVersion,
)
from tidal.slurm.hostlist import compress
from tidal.slurm.models import Job, Node, Partition, SlurmVersion, UnitOwner, UnitSubmission

DEFAULT_TIMEOUT_S = 10.0

# The newest JSON schema Tidal reads that each release prints, newest release first: a
# release prints its own data_parser version and the two or three before it (24.05:
# v0.0.39-41, 25.11: v0.0.42-44, 26.05: v0.0.42-45).
_PINNED_SCHEMAS = (
    (SlurmVersion(26, 5), "v0.0.45"),
    (SlurmVersion(25, 11), "v0.0.44"),
    (SlurmVersion(25, 5), "v0.0.43"),
    (SlurmVersion(24, 11), "v0.0.42"),
    (SlurmVersion(24, 5), "v0.0.41"),
    (SlurmVersion(23, 11), "v0.0.40"),
)


def json_flag(version: SlurmVersion) -> str:
    """The --json option that asks Slurm `version` for the newest schema Tidal reads.

    21.08/22.05 print openapi v0.0.37/38 and take no version; 23.02 prints only v0.0.39,
    which Tidal does not read (UnsupportedSlurmVersion); releases after 26.05 are asked
    for v0.0.45 for as long as they still print it."""
    for first_release, schema in _PINNED_SCHEMAS:
        if version >= first_release:
            return f"--json={schema}"
    if version < SlurmVersion(23, 2):
        return "--json"
    raise UnsupportedSlurmVersion(
        f"Slurm {version} prints JSON schema v0.0.39, which Tidal does not read; "
        "use 22.05, or 23.11 and later")


class CliJsonSlurmClient:
    """SlurmClient over the CLI. `bin_dir` picks the Slurm commands (default: PATH);
    `slurm_conf` overrides $SLURM_CONF for the commands this client runs."""

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, slurm_conf: str | None = None,
                 bin_dir: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.slurm_conf = slurm_conf
        self.bin_dir = bin_dir
        self._version: SlurmVersion | None = None

    # ------------------------------------------------------------------ plumbing

    def _environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        if extra:
            env.update(extra)
        return env

    def _run(self, argv: Sequence[str], *, stdin: str | None = None,
             env: Mapping[str, str] | None = None, owner: UnitOwner | None = None) -> str:
        """Run a Slurm command; as `owner` (uid, gid, groups, umask 077, an environment of
        the owner's own plus where Slurm is) when given."""
        program = os.path.join(self.bin_dir, argv[0]) if self.bin_dir else argv[0]
        command = [program, *argv[1:]]
        as_owner: dict[str, Any] = {}
        if owner is not None:
            slurm_conf = self._environment().get("SLURM_CONF")
            env = {**owner.environment(), "PATH": os.environ.get("PATH", owner.environment()["PATH"]),
                   **({"SLURM_CONF": slurm_conf} if slurm_conf else {})}
            command = owner.command(command)
            as_owner = {"umask": 0o077, "cwd": owner.home if os.path.isdir(owner.home) else "/"}
        try:
            # (Bytes that are not UTF-8, a Latin-1 job name of any user's that Slurm prints
            # raw, are replaced: strict decoding raised, and stopped the controller's polls.)
            result = subprocess.run(command, input=stdin, capture_output=True, text=True, encoding="utf-8",
                                    errors="replace", timeout=self.timeout_s, env=dict(env or self._environment()),
                                    **as_owner)
        except FileNotFoundError:
            raise SlurmNotInstalled(argv[0]) from None
        except subprocess.TimeoutExpired:
            # subprocess.run has killed the command by now.
            raise SlurmTimeout(argv, self.timeout_s) from None
        except (OSError, ValueError) as error:
            # (Not executable, too many processes, a NUL in an argument.)
            raise SlurmCommandFailed(argv, -1, f"cannot run it: {error}") from None
        if result.returncode != 0:
            raise SlurmCommandFailed(argv, result.returncode, result.stderr)
        return result.stdout

    def _json_flag(self) -> str:
        return json_flag(self.version())

    # ------------------------------------------------------------------ reads

    def version(self) -> SlurmVersion:
        if self._version is None:
            self._version = parse.parse_version(self._run(["scontrol", "--version"]))
        return self._version

    def list_nodes(self) -> list[Node]:
        flag = self._json_flag()
        if self.version() < SlurmVersion(23, 11):
            return parse.parse_nodes(self._run(["sinfo", flag]))
        return parse.parse_nodes(self._run(["scontrol", "show", "nodes", flag]))

    def list_partitions(self) -> list[Partition]:
        return parse.parse_partitions_oneliner(self._run(["scontrol", "show", "partition", "--oneliner"]))

    def list_jobs(self, user: str | None = None) -> list[Job]:
        jobs = parse.parse_jobs(self._run(["squeue", self._json_flag()]))
        return [job for job in jobs if user is None or job.user == user]

    def get_job(self, job_id: int) -> Job:
        for job in self.list_jobs():
            if job.job_id == job_id:
                return job
        raise SlurmJobNotFound(job_id)

    # ------------------------------------------------------------------ writes

    def submit(self, unit: UnitSubmission) -> int:
        if self._for_owner(unit):
            # Another user's unit: sbatch runs as that user with --export=NONE, and the
            # script sets the unit's whole environment itself.
            output = self._run(["sbatch", "--parsable", *self._sbatch_options(unit)], stdin=unit.script_for_owner(),
                               owner=unit.owner)
        else:
            # The unit's environment (the path of the job's secret among it) travels in
            # sbatch's own environment, which --export=ALL hands to the job; never in argv.
            output = self._run(["sbatch", "--parsable", *self._sbatch_options(unit)], stdin=unit.script,
                               env=self._environment(unit.environment))
        return parse.parse_sbatch_parsable(output)

    def check(self, unit: UnitSubmission) -> None:
        # `sbatch --test-only` validates everything sbatch and slurmctld check at submission
        # (partition, nodes, GRES, constraint, limits; as the owner: the owner's access)
        # and answers when the job would start; it creates no job.
        self._run(["sbatch", "--test-only", *self._sbatch_options(unit)], stdin=unit.script,
                  owner=unit.owner if self._for_owner(unit) else None)

    @staticmethod
    def _for_owner(unit: UnitSubmission) -> bool:
        return unit.owner is not None and unit.owner.uid != os.geteuid()

    @staticmethod
    def _sbatch_options(unit: UnitSubmission) -> list[str]:
        argv = [*unit.extra_options, f"--job-name={unit.name}", f"--nodes={unit.nodes}"]
        if unit.partition:
            argv.append(f"--partition={unit.partition}")
        if unit.exclusive:
            argv.append("--exclusive")
        argv.append("--requeue" if unit.requeue else "--no-requeue")
        optional = {"--time": unit.time_limit, "--constraint": unit.constraint, "--gres": unit.gres,
                    "--account": unit.account, "--qos": unit.qos, "--chdir": unit.working_dir,
                    "--output": unit.output, "--comment": unit.comment}
        argv += [f"{option}={value}" for option, value in optional.items() if value]
        if unit.exclude_nodes:
            argv.append(f"--exclude={compress(unit.exclude_nodes)}")
        argv.append("--export=NONE" if CliJsonSlurmClient._for_owner(unit) else "--export=ALL")
        return argv

    def cancel(self, job_id: int, signal: str | None = None, *, batch_only: bool = False) -> None:
        argv = ["scancel"]
        if signal:
            # --full reaches the batch script too, not only the job's steps.
            argv += [f"--signal={signal}", "--batch" if batch_only else "--full"]
        argv.append(str(job_id))
        try:
            self._run(argv)
        except SlurmCommandFailed as error:
            if "already completing or completed" in error.stderr or "Job has already finished" in error.stderr:
                return
            if "Invalid job id" in error.stderr:
                raise SlurmJobNotFound(job_id) from None
            raise

    def shrink(self, job_id: int, node_count: int) -> None:
        if node_count < 1:
            raise ValueError("a running job keeps at least one node")
        try:
            self._run(["scontrol", "update", f"JobId={job_id}", f"NumNodes={node_count}"])
        except SlurmCommandFailed as error:
            if "Invalid job id" in error.stderr:
                raise SlurmJobNotFound(job_id) from None
            raise
