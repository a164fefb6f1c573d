"""Whose a job is, and acting as that user.

A controller running as root (the systemd service) runs each job's units as the job's
owner: sbatch runs with the owner's uid, gid and supplementary groups (as Open OnDemand and
batchspawner do; `sbatch --uid` is deprecated from Slurm 26.05), the unit's output folder
and the job's secret are made by the owner in the owner's space. Which owners a controller
takes is a pure decision (`refusal`); reading the account database and running commands
as the owner are the effects, kept here."""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import subprocess
from pathlib import Path

from tidal.controller.config import unit_folder
from tidal.slurm.models import UnitOwner


class UnknownOwner(LookupError):
    """No account on this host has the uid or name asked for."""


@dataclasses.dataclass(frozen=True)
class OwnerPolicy:
    """Whose jobs a controller takes (from its config and the uid it runs as)."""

    controller_uid: int
    min_uid: int = 1000
    allow_root: bool = False
    allow_system_users: bool = False


def refusal(policy: OwnerPolicy, uid: int, name: str) -> str | None:
    """Why a job of `uid` (`name`) is refused, or None when the controller takes it."""
    if (turned_away := serves(policy, uid)) is not None:
        return turned_away
    if uid == 0:
        return None if policy.allow_root else (
            "jobs of root are refused: submit as the user the training runs as "
            "(an admin allows root's jobs with allow_root_jobs = true)")
    if uid < policy.min_uid and not policy.allow_system_users:
        return (f"uid {uid} ({name}) is a system account (below min_owner_uid {policy.min_uid}); its jobs are "
                "refused (an admin allows them with allow_system_user_jobs = true)")
    return None


def serves(policy: OwnerPolicy, uid: int) -> str | None:
    """Why a controller that is not root turns `uid` away, or None: it serves its own user
    (and root) only, since it cannot act as anyone else."""
    if policy.controller_uid == 0 or uid in (0, policy.controller_uid):
        return None
    return (f"this controller runs as uid {policy.controller_uid} and serves that user only; uid {uid} "
            "needs a controller of its own, or the cluster's shared one (run as root)")


@dataclasses.dataclass(frozen=True)
class JobFiles:
    """Where one job's files go: its units' Slurm output, and its secret."""

    folder: Path
    secret: Path


def job_files(owner: UnitOwner, job_id: str, *, output_template: str, secrets_dir: Path,
              controller_uid: int) -> JobFiles:
    """A job of the controller's own user keeps its secret in the controller's secrets
    folder (as before); another user's secret is in that user's job folder, where the
    user's units can read it whatever the controller's state folder allows."""
    folder = unit_folder(output_template, home=owner.home, user=owner.name, job_id=job_id)
    secret = secrets_dir / f"{job_id}.secret" if owner.uid == controller_uid else folder / "secret"
    return JobFiles(folder=folder, secret=secret)


def account(uid: int) -> UnitOwner:
    """The account of `uid` on this host: name, primary group, supplementary groups, home."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        raise UnknownOwner(f"uid {uid} has no account on the controller's host") from None
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return UnitOwner(uid=uid, gid=entry.pw_gid, groups=groups, name=entry.pw_name, home=entry.pw_dir,
                     shell=entry.pw_shell)


def account_named(name: str) -> UnitOwner:
    try:
        return account(pwd.getpwnam(name).pw_uid)
    except KeyError:
        raise UnknownOwner(f"no account named {name!r} on the controller's host") from None


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def is_self(owner: UnitOwner) -> bool:
    return owner.uid == os.geteuid()


def run_as(owner: UnitOwner, argv: list[str], *, stdin: str | None = None,
           timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run `argv` as the owner (uid, gid and groups; umask 077; the owner's environment),
    from the owner's home. As the controller's own user when the owner is that user."""
    home = owner.home if os.path.isdir(owner.home) else "/"
    if is_self(owner):
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s, cwd=home,
                              umask=0o077, env=owner.environment())
    return subprocess.run(owner.command(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s,
                          cwd=home, umask=0o077, env=owner.environment())


class OwnerActionFailed(OSError):
    pass


def make_private_folder(owner: UnitOwner, folder: Path) -> None:
    """`folder` and its missing parents, made by the owner (mode 0700), so that nothing the
    owner does not own is ever written into the owner's space."""
    if is_self(owner):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    result = run_as(owner, ["mkdir", "-p", "-m", "700", "--", str(folder)])
    if result.returncode != 0:
        raise OwnerActionFailed(f"{owner.name} could not make {folder}: exit {result.returncode}: "
                                f"{(result.stderr or result.stdout).strip()}")


def write_private_file_as(owner: UnitOwner, path: Path, content: str) -> None:
    """`content` into `path` (mode 0600), written by the owner and moved into place at once;
    the content travels on stdin, never in argv."""
    make_private_folder(owner, path.parent)
    temporary = path.with_name(f".{path.name}.tmp")
    script = 'umask 077 && cat > "$1" && mv -f -- "$1" "$2"'
    result = run_as(owner, ["/bin/sh", "-c", script, "sh", str(temporary), str(path)], stdin=content)
    if result.returncode != 0:
        raise OwnerActionFailed(f"{owner.name} could not write {path}: exit {result.returncode}: "
                                f"{(result.stderr or result.stdout).strip()}")
