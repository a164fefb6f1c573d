"""Scaling on simulated accelerators: samples/s of the example language model in live mode
at fixed worlds of 1, 2 and 4 replicas on loopback, each worker a simulated H100
(`tidal.train.simulated`), and the scaling efficiency, samples/s at N / (N × samples/s at
1). Goal: at least 0.9 at every N.

On this machine N real workers share 2 cores, so a bigger world of the tiny model alone
trains slower. With simulated accelerators each micro-batch takes the time an H100 would
take for a 1B-parameter model's 4096-token samples, and each step adds a ring all-reduce
of its BF16 gradients over 400 Gb/s, in sleeps that use no CPU, while the real model's
numerics and accounting stay as they are: what is measured is what Tidal adds to a
cluster of N such nodes. The model's own expectation (its compute and all-reduce times
alone) is reported beside each figure."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from bench.common import LM_EXAMPLE, Row, median, parser, steady_rate, workspace, write_result
from bench.live import commit_times, run_fixed_world
from tidal.train.data import share_bounds
from tidal.train.simulated import ACCELERATORS, Simulation

WORLDS = (1, 2, 4)
GLOBAL_BATCH = 64
MICRO_BATCH = 16
MODEL = ["--global-batch", str(GLOBAL_BATCH), "--micro-batch", str(MICRO_BATCH), "--context", "64", "--width", "64",
         "--layers", "2"]
SIMULATION = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=4096)
# --quick: a model 10× smaller, so that each step is 10× shorter.
QUICK_SIMULATION = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e8, tokens_per_sample=4096)
GOAL_EFFICIENCY = 0.9


def simulation_flags(simulation: Simulation) -> list[str]:
    """The LM example's flags for `simulation`."""
    accelerator = next(key for key, value in ACCELERATORS.items() if value == simulation.accelerator)
    return ["--simulate-accelerator", accelerator, "--simulated-params", repr(simulation.parameters),
            "--simulated-tokens-per-sample", str(simulation.tokens_per_sample), "--simulated-mfu", repr(simulation.mfu),
            "--simulated-link-gbps", repr(simulation.link.bytes_per_s * 8 / 1e9),
            "--simulated-gradient-bytes", str(simulation.gradient_bytes_per_parameter)]


def modelled_step_seconds(simulation: Simulation, replicas: int) -> float:
    """A step's time by the simulation alone: the slowest rank's micro-batches, then the
    gradient all-reduce (what the real model and Tidal add is left out)."""
    compute = []
    for rank in range(replicas):
        start, end = share_bounds(GLOBAL_BATCH, rank, replicas)
        sizes = [min(MICRO_BATCH, end - first) for first in range(start, end, MICRO_BATCH)]
        compute.append(sum(simulation.micro_batch_seconds(size) for size in sizes))
    return max(compute) + simulation.reduction_seconds(replicas)


def samples_per_second(folder: Path, simulation: Simulation, replicas: int, steps: int, skip: int) -> float:
    ledger = folder / "ledger"
    run_fixed_world(folder, [sys.executable, str(LM_EXAMPLE), "--steps", str(steps), "--log-every", "1000",
                             "--ledger-dir", str(ledger), *MODEL, *simulation_flags(simulation)], replicas, "scaling")
    commits = commit_times(ledger, replicas)
    assert len(commits) >= steps - 1, f"only {len(commits)} steps committed at world size {replicas}"
    return steady_rate(commits, skip) * GLOBAL_BATCH


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeat = args.repeat or (1 if args.quick else 2)
    simulation = QUICK_SIMULATION if args.quick else SIMULATION
    steps, skip = (6, 2) if args.quick else (10, 2)
    measured: dict[int, list[float]] = {replicas: [] for replicas in WORLDS}
    with workspace(args.keep, "scaling") as folder:
        for index in range(repeat):
            for replicas in WORLDS:
                rate = samples_per_second(folder / f"world-{replicas}-{index}", simulation, replicas, steps, skip)
                measured[replicas].append(rate)
                print(f"scaling: repetition {index + 1}, {replicas} replicas: {rate:.2f} samples/s", flush=True)
    single = median(measured[1])
    modelled_single = GLOBAL_BATCH / modelled_step_seconds(simulation, 1)
    size = f"{simulation.parameters / 1e9:g}B parameters"
    rows = [Row(benchmark="scaling", metric=f"samples/s, LM on 1 simulated H100 ({size}), live mode",
                unit="samples/s", tidal=single, goal="reported (the reference)", met=math.isfinite(single),
                tidal_samples=measured[1],
                note=f"the simulation alone: {modelled_single:.4g} samples/s "
                     f"({GLOBAL_BATCH / modelled_single:.3f} s a step)")]
    for replicas in WORLDS[1:]:
        # Per-repetition efficiencies: each world against the single replica of its own round.
        efficiencies = [rate / (replicas * base) for rate, base in zip(measured[replicas], measured[1], strict=True)]
        efficiency = median(efficiencies)
        modelled = GLOBAL_BATCH / modelled_step_seconds(simulation, replicas)
        rows.append(Row(benchmark="scaling",
                        metric=f"samples/s, LM on {replicas} simulated H100s ({size}), live mode, "
                               f"vs {replicas} × 1 replica",
                        unit="samples/s", tidal=median(measured[replicas]), baseline=replicas * single,
                        baseline_name=f"{replicas} × one replica's", tidal_samples=measured[replicas],
                        baseline_samples=[replicas * rate for rate in measured[1]], ratio=efficiency,
                        ratio_meaning=f"scaling efficiency: samples/s at {replicas} / ({replicas} × at 1)",
                        goal=f"efficiency ≥ {GOAL_EFFICIENCY}", met=efficiency >= GOAL_EFFICIENCY,
                        note=f"efficiencies by repetition {', '.join(f'{e:.3f}' for e in efficiencies)}; the "
                             f"simulation alone expects {modelled:.4g} samples/s, efficiency "
                             f"{modelled / (replicas * modelled_single):.3f} (its all-reduce "
                             f"{simulation.reduction_seconds(replicas) * 1000:.0f} ms a step, not overlapped)"))
    write_result("scaling", rows, quick=args.quick,
                 settings={"steps": steps, "skip": skip, "repeat": repeat, "worlds": list(WORLDS),
                           "model": " ".join(MODEL), "simulation": " ".join(simulation_flags(simulation))},
                 text=SIMULATED_MODEL_TEXT)


SIMULATED_MODEL_TEXT = (
    "Each worker trains the real LM (its numerics and per-sample accounting unchanged) on a simulated accelerator "
    "(`tidal.train.simulated`, `--simulate-accelerator h100`): a micro-batch of s samples costs 6 × parameters × s "
    "× tokens-per-sample FLOPs, at the accelerator's dense peak × MFU (H100 SXM, dense BF16: 989 TFLOP/s × 0.4; a "
    "1B-parameter model, 4096 tokens a sample: 0.99 s for a micro-batch of 16), and takes at least that long: the "
    "rest after its real forward and backward passes is slept, using no CPU. Each step adds, in full (not "
    "overlapped with the backward pass), a ring all-reduce of the BF16 gradients, 2 (n − 1) / n × 2 GB over "
    "InfiniBand NDR (400 Gb/s = 50 GB/s a rank), n the step's replicas: 40 ms at 2, 60 ms at 4, none at 1; the "
    "real (small) all-reduce runs too. Global batch 64, micro-batches of 16.")


if __name__ == "__main__":
    main()
