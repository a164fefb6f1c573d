"""Overhead: steps/s of the example language model trained by Tidal's live mode (a
controller, two launchers, the worker library, world fixed at 2) against the same model
in a plain torch.distributed script (DDP under torchrun, 2 ranks), and torchft 0.2.0 (when
installed) with 2 replica groups on the same model and global batch.

Many short runs in interleaved pairs (the order flips every pair, so a slow drift of this
shared machine falls on both sides alike); the row is the median of the per-pair ratios
with its distribution-free 95% interval. Beside wall time, the CPU seconds each step costs:
the workers' (their own process time, from their logs) plus the agents' (Tidal: the
controller and the launchers; DDP: torchrun's agent; torchft: the lighthouse), over the
same steady steps. The pairs are run twice: on the host's CPU alone, and with each worker
on a simulated H100 (`tidal.train.simulated`, a 0.1B-parameter model), where the device
time dominates a step as it does on a GPU cluster. Goal: Tidal within 2% of plain DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import (
    DDP_BASELINE,
    LM_EXAMPLE,
    CpuSampler,
    Row,
    median,
    median_interval,
    parser,
    read_jsonl,
    workspace,
    write_result,
)
from bench.live import run_fixed_world
from bench.scaling import simulation_flags
from bench.torchft_job import TorchftJob, torchft_lighthouse, torchft_name
from tidal.train.simulated import ACCELERATORS, Simulation

WORLD = 2
MODEL = ["--global-batch", "32", "--micro-batch", "16", "--context", "64", "--width", "64", "--layers", "2"]
SIMULATION = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e8, tokens_per_sample=4096)
GOAL_SLOWDOWN = 0.02


@dataclass(frozen=True)
class Settings:
    """One series of pairs: how many, how long each run is, which steps count."""

    name: str
    pairs: int
    steps: int
    skip: int
    flags: tuple[str, ...] = ()
    with_torchft: bool = True


@dataclass(frozen=True)
class Run:
    """One run's steady steps (after `skip`): steps/s, and CPU seconds per step."""

    steps_per_s: float
    worker_cpu_per_step: float
    agent_cpu_per_step: float
    # Runs it took (torchft's is run again once when its first attempt gave no rate).
    attempts: int = 1

    @property
    def cpu_per_step(self) -> float:
        return self.worker_cpu_per_step + self.agent_cpu_per_step


def steady_run(records: Sequence[dict[str, Any]], skip: int, agents: CpuSampler, key: str = "rank") -> Run:
    """A run from its per-step records (time, cpu_s, and `key` naming the process: rank or
    replica group): the rate of the first process's steps from its `skip`-th on, each
    process's CPU over those steps, and the agents' over the same wall-clock window."""
    by_process: dict[Any, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["time"]):
        by_process.setdefault(record[key], []).append(record)
    first = by_process[min(by_process)][skip:]
    if len(first) < 2:
        return Run(float("nan"), float("nan"), float("nan"))
    steps = len(first) - 1
    start, end = first[0]["time"], first[-1]["time"]
    worker_cpu = sum(kept[-1]["cpu_s"] - kept[0]["cpu_s"] for kept in (r[skip:] for r in by_process.values())
                     if len(kept) >= 2)
    return Run(steps_per_s=steps / (end - start), worker_cpu_per_step=worker_cpu / steps,
               agent_cpu_per_step=agents.between(start, end) / steps)


def tidal_run(folder: Path, settings: Settings) -> Run:
    ledger = folder / "ledger"
    agents = CpuSampler()
    run_fixed_world(folder, [sys.executable, str(LM_EXAMPLE), "--steps", str(settings.steps), "--log-every", "1000",
                             "--ledger-dir", str(ledger), *MODEL, *settings.flags], WORLD, "overhead",
                    agents_cpu=agents)
    commits = [r for r in read_jsonl(sorted(ledger.glob("ledger-*.jsonl")))
               if r["kind"] == "commit" and r["world_size"] == WORLD]
    assert len({r["step"] for r in commits}) >= settings.steps - 1, f"only {len(commits)} commits at world {WORLD}"
    return steady_run(commits, settings.skip, agents)


def ddp_run(folder: Path, settings: Settings) -> Run:
    logs = folder / "ddp-log"
    agents = CpuSampler()
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 str(WORLD), str(DDP_BASELINE), "--steps", str(settings.steps), "--log-dir", str(logs),
                                 *MODEL, *settings.flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    agents.start(lambda: [torchrun.pid])
    try:
        _, errors = torchrun.communicate(timeout=600)
    finally:
        agents.stop()
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
    if torchrun.returncode != 0:
        raise RuntimeError(f"the DDP baseline exited {torchrun.returncode}: {errors.decode()[-2000:]}")
    return steady_run(read_jsonl(sorted(logs.glob("*.jsonl"))), settings.skip, agents)


def torchft_run(folder: Path, settings: Settings, lighthouse: Path) -> Run:
    """torchft with WORLD replica groups on the same model and global batch. A run whose
    first group committed too few steps for a rate (once, in make test's quick run of
    2026-11-29: every group exited 0; its logs were not kept) is run again once, in a
    folder of its own (the first kept beside it); the row's note counts such runs."""
    run = torchft_attempt(folder, settings, lighthouse)
    if run.steps_per_s == run.steps_per_s:
        return run
    print(f"overhead: torchft run in {folder} gave no steady rate; running it again", flush=True)
    return replace(torchft_attempt(folder / "again", settings, lighthouse), attempts=2)


def torchft_attempt(folder: Path, settings: Settings, lighthouse: Path) -> Run:
    agents = CpuSampler()
    with TorchftJob(folder, lighthouse, WORLD, [*MODEL, *settings.flags], steps=settings.steps) as job:
        agents.start(lambda: [job.processes[0].pid])
        try:
            job.wait_done(600)
        finally:
            agents.stop()
        records = job.steps(0)
    return steady_run(records, settings.skip, agents, key="replica")


def run_pairs(folder: Path, settings: Settings, lighthouse: Path | None) -> dict[str, list[Run]]:
    """`settings.pairs` interleaved pairs (with torchft, triples); the order flips each pair."""
    kinds = ["ddp", "tidal", *(["torchft"] if lighthouse is not None and settings.with_torchft else [])]
    runs: dict[str, list[Run]] = {kind: [] for kind in kinds}
    for index in range(settings.pairs):
        for kind in kinds if index % 2 == 0 else reversed(kinds):
            where = folder / f"{settings.name}-{index}-{kind}"
            if kind == "ddp":
                runs[kind].append(ddp_run(where, settings))
            elif kind == "tidal":
                runs[kind].append(tidal_run(where, settings))
            else:
                assert lighthouse is not None
                runs[kind].append(torchft_run(where, settings, lighthouse))
        print(f"overhead: {settings.name} pair {index + 1}: "
              + ", ".join(f"{kind} {r[-1].steps_per_s:.2f} steps/s, {r[-1].cpu_per_step * 1000:.1f} ms CPU/step"
                          for kind, r in runs.items()), flush=True)
    return runs


def interval_text(ratios: Sequence[float]) -> str:
    low, high = median_interval(ratios)
    return (f"95% interval of the median {low:.3f}–{high:.3f}" if low == low
            else "too few pairs for a 95% interval of the median")


def rows_for(settings: Settings, runs: dict[str, list[Run]], label: str) -> list[Row]:
    tidal, ddp = runs["tidal"], runs["ddp"]
    ratios = [t.steps_per_s / b.steps_per_s for t, b in zip(tidal, ddp, strict=True)]
    cpu_ratios = [t.cpu_per_step / b.cpu_per_step for t, b in zip(tidal, ddp, strict=True)]
    low, _ = median_interval(ratios)
    slowdown = 1 - median(ratios)
    window = f"{settings.pairs} interleaved pairs of {settings.steps}-step runs, rate over steps {settings.skip}.."
    rows = [Row(
        benchmark="overhead", metric=f"steps/s, {label}, world {WORLD}, live mode vs plain DDP", unit="steps/s",
        tidal=median([r.steps_per_s for r in tidal]), baseline=median([r.steps_per_s for r in ddp]),
        baseline_name="plain DDP under torchrun", goal=f"Tidal ≤ {GOAL_SLOWDOWN:.0%} slower",
        met=slowdown <= GOAL_SLOWDOWN, tidal_samples=[r.steps_per_s for r in tidal],
        baseline_samples=[r.steps_per_s for r in ddp], ratio=median(ratios),
        ratio_meaning="Tidal / plain steps/s (median of pairs)",
        note=f"{slowdown:+.1%} slower; {interval_text(ratios)}"
             + (f" (its low end {'meets' if 1 - low <= GOAL_SLOWDOWN else 'misses'} the goal)" if low == low else "")
             + f"; per-pair ratios {', '.join(f'{r:.3f}' for r in ratios)}; {window}{settings.steps}"),
        Row(benchmark="overhead", metric=f"CPU seconds per step (workers + agents), {label}, world {WORLD}, "
                                         "live mode vs plain DDP", unit="s",
            tidal=median([r.cpu_per_step for r in tidal]), baseline=median([r.cpu_per_step for r in ddp]),
            baseline_name="plain DDP under torchrun (its workers + torchrun's agent)", goal="reported (no goal)",
            met=True, tidal_samples=[r.cpu_per_step for r in tidal], baseline_samples=[r.cpu_per_step for r in ddp],
            ratio=median(cpu_ratios), ratio_meaning="Tidal / plain CPU per step (median of pairs)",
            note=f"{interval_text(cpu_ratios)}; of Tidal's, workers "
                 f"{median([r.worker_cpu_per_step for r in tidal]) * 1000:.1f} ms and controller + launchers "
                 f"{median([r.agent_cpu_per_step for r in tidal]) * 1000:.2f} ms a step; DDP's workers "
                 f"{median([r.worker_cpu_per_step for r in ddp]) * 1000:.1f} ms, torchrun's agent "
                 f"{median([r.agent_cpu_per_step for r in ddp]) * 1000:.2f} ms; {window}{settings.steps}")]
    if "torchft" in runs:
        peer = runs["torchft"]
        peer_ratios = [t.steps_per_s / p.steps_per_s for t, p in zip(tidal, peer, strict=True)]
        peer_vs_ddp = median([p.steps_per_s / b.steps_per_s for p, b in zip(peer, ddp, strict=True)])
        rows.append(Row(
            benchmark="overhead", metric=f"steps/s, {label}, world {WORLD}, live mode vs torchft", unit="steps/s",
            tidal=median([r.steps_per_s for r in tidal]), baseline=median([r.steps_per_s for r in peer]),
            baseline_name=torchft_name("ddp"), goal="reported (no goal)", met=True,
            tidal_samples=[r.steps_per_s for r in tidal], baseline_samples=[r.steps_per_s for r in peer],
            ratio=median(peer_ratios), ratio_meaning="Tidal / torchft steps/s (median of triples)",
            note=f"{interval_text(peer_ratios)}; torchft / plain DDP steps/s {peer_vs_ddp:.3f}; torchft's CPU a step "
                 f"{median([r.cpu_per_step for r in peer]) * 1000:.1f} ms (workers + lighthouse) against Tidal's "
                 f"{median([r.cpu_per_step for r in tidal]) * 1000:.1f} ms; torchft runs its quorum with the "
                 f"lighthouse every step; {window}{settings.steps}"
                 + (f"; torchft runs run again after a first attempt with no steady rate: "
                    f"{sum(r.attempts > 1 for r in peer)}" if any(r.attempts > 1 for r in peer) else "")))
    return rows


def main() -> None:
    options = parser(__doc__.split("\n\n")[0])
    options.add_argument("--series", choices=("cpu", "simulated", "both"), default="both",
                         help="which series of pairs to run (a full run of both takes about 15 minutes)")
    args = options.parse_args()
    flags = tuple(simulation_flags(SIMULATION))
    if args.quick:
        # The CPU series alone: the simulated one runs the same code with the simulation's flags
        # (which bench.goodput's and bench.grow's quick runs pass too), and `make test` is
        # held to 35 minutes.
        series = [Settings("cpu", args.repeat or 1, 40, 10)]
    else:
        series = [Settings("cpu", args.repeat or 10, 200, 40), Settings("simulated", 6, 80, 20, flags, False)]
    series = [s for s in series if args.series in ("both", s.name)]
    lighthouse = torchft_lighthouse()
    if lighthouse is None:
        print("overhead: torchft is not installed here (pip install torchft==0.2.0): its row is left out", flush=True)
    rows: list[Row] = []
    with workspace(args.keep, "overhead") as folder:
        for settings in series:
            label = "LM" if settings.name == "cpu" else f"LM on simulated H100s ({SIMULATION.parameters / 1e9:g}B)"
            rows += rows_for(settings, run_pairs(folder, settings, lighthouse), label)
    write_result("overhead", rows, quick=args.quick, settings={
        "series": [{"name": s.name, "pairs": s.pairs, "steps": s.steps, "skip": s.skip, "flags": " ".join(s.flags),
                    "torchft": s.with_torchft and lighthouse is not None} for s in series],
        "world": WORLD, "model": " ".join(MODEL), "simulated": SIMULATION.describe()})


if __name__ == "__main__":
    main()
