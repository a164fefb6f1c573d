"""The fake implements the same Protocol as the real clients, and a failed poll of Slurm
never reads as "nothing changed"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tidal.slurm import CliJsonSlurmClient, JobState, SlurmClient, SlurmTimeout, UnitSubmission
from tidal.slurm.errors import SlurmParseError
from tidal.slurm.fake import FakeSlurmClient
from tidal.slurm.pyslurm_backend import PyslurmSlurmClient
from tidal.slurm.snapshot import ClusterPoll, StaleClusterView


def test_every_backend_satisfies_the_protocol() -> None:
    for client in (FakeSlurmClient.with_nodes(2), CliJsonSlurmClient(), PyslurmSlurmClient(module=object())):
        assert isinstance(client, SlurmClient)


def test_fake_runs_preempts_and_requeues_like_slurm() -> None:
    fake = FakeSlurmClient.with_nodes(2)
    first = fake.submit(UnitSubmission(name="unit-1", script="#!/bin/sh\n"))
    second = fake.submit(UnitSubmission(name="unit-2", script="#!/bin/sh\n", exclude_nodes=("n1",)))
    third = fake.submit(UnitSubmission(name="unit-3", script="#!/bin/sh\n"))
    assert fake.get_job(first).nodes == ("n1",) and fake.get_job(second).nodes == ("n2",)
    assert fake.get_job(third).state is JobState.PENDING and fake.get_job(third).reason == "Resources"
    fake.preempt(first)
    assert fake.get_job(first).is_being_preempted
    fake.requeue(first)
    job = fake.get_job(first)
    assert job.state is JobState.PENDING and job.was_requeued and not job.is_being_preempted
    fake.schedule()  # oldest first: the requeued unit gets its node back before unit-3
    assert fake.get_job(first).nodes == ("n1",) and fake.get_job(third).state is JobState.PENDING


def test_fake_failure_switches() -> None:
    fake = FakeSlurmClient.with_nodes(1)
    fake.fail_next("list_jobs", SlurmTimeout(["squeue"], 10))
    with pytest.raises(SlurmTimeout):
        fake.list_jobs()
    assert fake.list_jobs() == []
    fake.unavailable = True
    with pytest.raises(SlurmTimeout):
        fake.list_nodes()


def test_failed_poll_keeps_last_view_marked_stale() -> None:
    fake = FakeSlurmClient.with_nodes(2)
    now = [100.0]
    poll = ClusterPoll(fake, clock=lambda: now[0])
    with pytest.raises(StaleClusterView):
        poll.last.require_fresh()  # nothing read yet: never "an empty cluster"
    fake.submit(UnitSubmission(name="unit", script="#!/bin/sh\n"))
    fresh = poll.poll()
    assert not fresh.stale and fresh.observed_at == 100.0 and len(fresh.jobs) == 1
    now[0] = 130.0
    fake.unavailable = True
    stale = poll.poll()
    stale = poll.poll()
    assert stale.stale and stale.consecutive_failures == 2 and isinstance(stale.error, SlurmTimeout)
    assert stale.jobs == fresh.jobs and stale.observed_at == 100.0  # the last known state, with its age
    with pytest.raises(StaleClusterView, match="2 failed polls"):
        stale.require_fresh()
    fake.unavailable = False
    assert not poll.poll().stale


def test_a_poll_whose_reading_raises_anything_is_a_stale_view_not_a_dead_poll_loop() -> None:
    """A reading that raised something other than a SlurmError (Slurm's nonsense in a shape
    the parser did not foresee, a bug) escaped the poll, ended the controller's polling
    task for good, and the daemon ran on without ever seeing Slurm again."""
    fake = FakeSlurmClient.with_nodes(2)
    poll = ClusterPoll(fake)
    assert not poll.poll().stale

    def broken() -> list[object]:
        raise AttributeError("'NoneType' object has no attribute 'get'")

    fake.list_jobs = broken  # type: ignore[method-assign]
    stale = poll.poll()
    assert stale.stale and isinstance(stale.error, SlurmParseError) and stale.consecutive_failures == 1
    assert "unexpected AttributeError" in str(stale.error) and len(stale.nodes) == 2


def test_readiness_asks_slurmctld_not_only_the_local_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under require_slurm the health check reported SERVING with slurmctld down: it ran
    `scontrol --version`, which the local binary answers without asking slurmctld. The
    check asks slurmctld too, and says why it is not ready, naming the command."""
    from tidal.controller import daemon

    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "slurm 24.11.5"; exit 0; fi\n'
                        'echo "slurm_load_partitions error: Unable to contact slurm controller (connect failure)" >&2\n'
                        "exit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("TIDAL_SLURM_BACKEND", "cli")
    problem = daemon._slurm_problem()
    assert problem is not None and "Unable to contact slurm controller" in problem, problem
    assert problem.startswith("Slurm does not answer: scontrol show partition")
