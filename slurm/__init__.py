"""Tidal's only door to Slurm: typed models, a `SlurmClient` Protocol and its backends.

    from tidal.slurm import default_client
    slurm = default_client()
    idle = [n for n in slurm.list_nodes() if n.is_idle_and_usable]
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tidal.slurm.client import SlurmClient
from tidal.slurm.errors import (
    SlurmCommandFailed,
    SlurmError,
    SlurmJobNotFound,
    SlurmNotInstalled,
    SlurmParseError,
    SlurmReportedError,
    SlurmTimeout,
    UnsupportedSlurmVersion,
)
from tidal.slurm.models import (
    Gres,
    Job,
    JobFlag,
    JobState,
    Node,
    NodeFlag,
    NodeState,
    Partition,
    PreemptMode,
    SlurmVersion,
    UnitSubmission,
)

__all__ = [
    "CliJsonSlurmClient", "Gres", "Job", "JobFlag", "JobState", "Node", "NodeFlag", "NodeState",
    "Partition", "PreemptMode", "SlurmClient", "SlurmCommandFailed", "SlurmError",
    "SlurmJobNotFound", "SlurmNotInstalled", "SlurmParseError", "SlurmReportedError", "SlurmTimeout", "SlurmVersion",
    "UnitSubmission", "UnsupportedSlurmVersion", "default_client",
]

if TYPE_CHECKING:
    from tidal.slurm.cli_json import CliJsonSlurmClient

BACKEND_VARIABLE = "TIDAL_SLURM_BACKEND"


def __getattr__(name: str) -> Any:
    """`CliJsonSlurmClient` on first use: the CLI backend imports subprocess, which the
    controller's pure core (it reads `tidal.slurm.models`) has no use for."""
    if name == "CliJsonSlurmClient":
        from tidal.slurm.cli_json import CliJsonSlurmClient

        return CliJsonSlurmClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_client(*, timeout_s: float | None = None, backend: str | None = None) -> SlurmClient:
    """The SlurmClient for this machine, honouring $SLURM_CONF.

    `backend` (or $TIDAL_SLURM_BACKEND): "cli" (Slurm's commands with --json), "pyslurm",
    or "auto" (the default): pyslurm only where it imports and was built for the
    cluster's Slurm major.minor, the CLI backend otherwise."""
    from tidal.slurm.cli_json import DEFAULT_TIMEOUT_S, CliJsonSlurmClient

    choice = (backend or os.environ.get(BACKEND_VARIABLE) or "auto").lower()
    cli = CliJsonSlurmClient(timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
                             slurm_conf=os.environ.get("SLURM_CONF"))
    if choice == "cli":
        return cli
    if choice not in ("auto", "pyslurm"):
        raise ValueError(f"{BACKEND_VARIABLE}={choice!r}: expected auto, cli or pyslurm")
    try:
        import pyslurm  # type: ignore[import-not-found]
    except ImportError:
        if choice == "pyslurm":
            raise
        return cli
    from tidal.slurm.pyslurm_backend import PyslurmSlurmClient, pyslurm_version

    if choice == "pyslurm":
        return PyslurmSlurmClient(pyslurm)
    try:
        cluster = cli.version()
    except SlurmError:
        return cli
    built_for = pyslurm_version(pyslurm)
    if (built_for.major, built_for.minor) == (cluster.major, cluster.minor):
        return PyslurmSlurmClient(pyslurm)
    return cli
