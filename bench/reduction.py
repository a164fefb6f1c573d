"""Gradient reduction: steps/s of Tidal's `DataParallel` strategy with its gradient
all-reduce overlapped with the backward pass, against the same strategy reducing after the
backward pass (`overlap=False`), and against plain PyTorch DDP, in a fixed world of 2 ranks
(gloo on this machine's CPU).

Goals: the overlapped reduction is faster than the one after the backward pass (the median
of the per-round ratios of steps/s above 1), and Tidal with it runs at ≥ 0.98 of plain
DDP's steps/s.

Method. The model is a wide MLP (12 Linear layers of 2048² weights: 50 M float32
parameters, 192 MB of gradients, in 12 buckets of ≤ 25 MB) on a small batch (global 32,
micro-batches of 8, so 2 a rank), so that the all-reduce of the gradients is a large part
of a step. bench/baselines/reduction_worker.py runs one rank in one mode: `tidal-overlap`
(`Elastic` with `DataParallel(bucket_mb=25, overlap=True)`), `tidal-no-overlap` (the same
with `overlap=False`) or `ddp` (`DistributedDataParallel(bucket_cap_mb=25)` over gloo's
default group, `no_sync` for all but the last micro-batch, each rank taking the samples
Tidal gives it; same seed, data, loss and SGD optimizer, so all three compute the same
losses, which is checked). Both ranks are started here with the torchrun environment (no
launcher: `Elastic` trains in that fixed world), OMP_NUM_THREADS=1.

A round runs each mode once, in its own pair of processes, for `steps` steps, the order
rotated from round to round; a run's figure is rank 0's steps per second over its steps
after the first `skip` (the first step, which forms the world, is never timed). The
machine is shared and noisy, so the comparisons are per round (runs next to each other in
time): a row gives the median of the per-round ratios, their spread (min–max) and a 95 %
interval of that median from order statistics (distribution-free: the k-th smallest and
k-th largest ratios, k from the binomial(n, ½) law). These are the first two rows, the
goals' figures.

Each round then runs the three step by step in one pair of processes (`interleaved`): a
Tidal job whose strategy's `overlap` is switched from one step to the next and a DDP copy
of the model beside it, `cycles` cycles of one step of each, the order rotated from cycle
to cycle. Steps a second apart see the same load, so these ratios are much tighter; they
make the third and fourth rows (same goals), with the median of every cycle's ratio too.
The same processes then run a probe that times the parts of a step apart: a micro-batch's
forward + backward alone, the buckets' all-reduce alone, the optimizer step, and the
micro-batch with that all-reduce running beside it: how much overlap this machine allows
at all. The workers also report CPU time per step (the process's, every thread: the main
one and gloo's; and the main thread's) and, under Tidal, the last micro-batch's backward
pass and the wait for the reduction after it: the notes."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, TORCHRUN_ENV, Row, median, parser, workspace, write_result

WORKER = REPO / "bench" / "baselines" / "reduction_worker.py"
WORLD = 2
MODES = ("tidal-overlap", "tidal-no-overlap", "ddp")
# (name in the results, faster mode, slower mode): each ratio is the first's steps/s over the second's.
RATIOS = (("overlap_vs_no_overlap", "tidal-overlap", "tidal-no-overlap"), ("overlap_vs_ddp", "tidal-overlap", "ddp"),
          ("no_overlap_vs_ddp", "tidal-no-overlap", "ddp"))
CONFIDENCE = 0.95
DDP_GOAL = 0.98
RUN_TIMEOUT_S = 600.0
LOSS_TOLERANCE = 1e-4
OUTPUTS = 16  # the MLP's last layer (reduction_worker.OUTPUTS)


@dataclass(frozen=True)
class Settings:
    width: int
    depth: int
    global_batch: int
    micro_batch: int
    bucket_mb: float
    # Separate runs: steps a run, the first `skip` of them (after the untimed first) not counted.
    steps: int
    skip: int
    rounds: int
    # The interleaved run (and its probe) in the first `interleaved_rounds` rounds.
    cycles: int
    cycle_skip: int
    probe_steps: int
    interleaved_rounds: int

    @property
    def parameters(self) -> int:
        return self.depth * (self.width + 1) * self.width + (self.width + 1) * OUTPUTS

    def worker_args(self) -> list[str]:
        return ["--width", str(self.width), "--depth", str(self.depth), "--global-batch", str(self.global_batch),
                "--micro-batch", str(self.micro_batch), "--bucket-mb", str(self.bucket_mb)]


FULL = Settings(width=2048, depth=12, global_batch=32, micro_batch=8, bucket_mb=25.0, steps=20, skip=3, rounds=10,
                cycles=20, cycle_skip=2, probe_steps=5, interleaved_rounds=10)
# --quick (make test) checks the code path, not the figure: one round of each mode.
QUICK = Settings(width=512, depth=4, global_batch=32, micro_batch=8, bucket_mb=1.0, steps=8, skip=2, rounds=1,
                 cycles=5, cycle_skip=1, probe_steps=3, interleaved_rounds=1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_ranks(mode: str, folder: Path, settings: Settings, extra: Sequence[str]) -> list[dict[str, Any]]:
    """Run the worker in `mode` on WORLD ranks (started here with the torchrun environment);
    every rank's record."""
    folder.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        port = free_port()
        processes: list[subprocess.Popen[bytes]] = []
        outputs = [folder / f"{mode}-rank{rank}.json" for rank in range(WORLD)]
        logs = [folder / f"{mode}-rank{rank}.log" for rank in range(WORLD)]
        try:
            for rank in range(WORLD):
                env = {**os.environ, **TORCHRUN_ENV, "RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD), "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                env.pop("TIDAL_CONTROL_SOCKET", None)
                with logs[rank].open("wb") as log:
                    processes.append(subprocess.Popen(
                        [sys.executable, str(WORKER), "--mode", mode, "--out", str(outputs[rank]),
                         *settings.worker_args(), *extra],
                        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + RUN_TIMEOUT_S
            codes = [process.wait(timeout=max(1.0, deadline - time.monotonic())) for process in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        if all(code == 0 for code in codes):
            return [json.loads(output.read_text()) for output in outputs]
        text = "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
        # The port was free when chosen; another process may have taken it since.
        if "address already in use" not in text.lower() or attempt == 2:
            raise RuntimeError(f"reduction: {mode} failed (exit codes {codes}):\n{text}")
    raise AssertionError("unreachable")


def check_losses(records: dict[str, dict[str, Any]]) -> None:
    """The three modes train the same model on the same samples: the same losses, up to
    float32 rounding (DDP averages gradients over ranks, Tidal sums them and divides by B)."""
    reference = records[MODES[0]]["loss"]
    for mode in MODES[1:]:
        losses = records[mode]["loss"]
        if len(losses) != len(reference) or any(abs(a - b) > LOSS_TOLERANCE * max(1.0, abs(a))
                                                for a, b in zip(losses, reference, strict=True)):
            raise AssertionError(f"reduction: {mode} computed other losses than {MODES[0]}: {losses} vs {reference}")


def rate(step_seconds: Sequence[float]) -> float:
    return len(step_seconds) / sum(step_seconds)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free interval for the median of `values`: its k-th smallest and k-th
    largest, k the largest for which the binomial(n, ½) law gives at least `confidence`.
    Returns (low, high, the interval's coverage); with too few values, min–max and its
    (lower) coverage."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return float("nan"), float("nan"), 0.0

    def coverage(k: int) -> float:
        # P(the median lies between the k-th smallest and the k-th largest of n values).
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def spread(values: Sequence[float], what: str = "per-round") -> str:
    low, high, covered = median_interval(values)
    return (f"median {median(values):.3f}, {what} min–max {min(values):.3f}–{max(values):.3f}, "
            f"{covered:.1%} interval of the median {low:.3f}–{high:.3f} (order statistics, n={len(values)})")


def thread_split(threads: Sequence[dict[str, Any]], steps: int) -> dict[str, float]:
    """CPU seconds a step by thread kind: the main thread, gloo's (its TCP loop and run
    loops) and any other."""
    split = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    for index, thread in enumerate(threads):
        kind = "main" if index == 0 else "gloo" if "gloo" in thread["name"] else "other"
        split[kind] += thread["cpu_s"] / steps
    return {kind: round(value, 4) for kind, value in split.items()}


def separate_round(records: dict[str, dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """One round of separate runs (rank 0's records, by mode), summarized."""
    skip = settings.skip

    def medians(key: str, modes: Sequence[str] = MODES) -> dict[str, float]:
        return {mode: median(records[mode][key][skip:]) for mode in modes}

    rates = {mode: rate(records[mode]["step_s"][skip:]) for mode in MODES}
    return {"steps_per_s": rates, **{name: rates[a] / rates[b] for name, a, b in RATIOS},
            "step_s": {mode: records[mode]["step_s"] for mode in MODES},
            "cpu_s_per_step": medians("cpu_s"), "main_cpu_s_per_step": medians("main_cpu_s"),
            "cpu_by_thread_per_step": {mode: thread_split(records[mode]["threads"], settings.steps - 1)
                                       for mode in MODES},
            "last_backward_s": medians("last_backward_s"), "finish_s": medians("finish_s", MODES[:2]),
            "buckets": records["tidal-overlap"]["buckets"]}


def interleaved_round(record: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """One interleaved run (rank 0's record), summarized: rates, per-round and per-cycle ratios."""
    skip = settings.cycle_skip
    steps = {mode: record["interleaved"]["step_s"][mode][skip:] for mode in MODES}
    rates = {mode: rate(steps[mode]) for mode in MODES}

    def medians(key: str, modes: Sequence[str] = MODES) -> dict[str, float]:
        return {mode: median(record["interleaved"][key][mode][skip:]) for mode in modes}

    return {"steps_per_s": rates, **{name: rates[a] / rates[b] for name, a, b in RATIOS},
            # A cycle's ratio of steps/s: the slower mode's step time over the faster's.
            "cycle_ratios": {name: [y / x for x, y in zip(steps[a], steps[b], strict=True)] for name, a, b in RATIOS},
            "step_s": record["interleaved"]["step_s"],
            "cpu_s_per_step": medians("cpu_s"), "main_cpu_s_per_step": medians("main_cpu_s"),
            "last_backward_s": medians("last_backward_s"), "finish_s": medians("finish_s", MODES[:2]),
            "probe": {name: median(values) for name, values in record.get("probe", {}).items()
                      if isinstance(values, list) and values and isinstance(values[0], float)},
            "probe_threads": thread_split(record.get("probe", {}).get("threads", []), max(1, settings.probe_steps))}


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    settings = QUICK if args.quick else FULL
    rounds_count = args.repeat or settings.rounds
    gradient_mb = settings.parameters * 4 / 2**20
    separate: list[dict[str, Any]] = []
    interleaved: list[dict[str, Any]] = []
    print(f"reduction: wide MLP of {settings.parameters / 1e6:.1f} M parameters ({gradient_mb:.0f} MB of gradients), "
          f"{rounds_count} rounds of {settings.steps} steps a mode", flush=True)
    with workspace(args.keep, "reduction") as folder:
        for index in range(rounds_count):
            order = MODES[index % len(MODES):] + MODES[:index % len(MODES)]
            round_folder = folder / f"round-{index}"
            records = {mode: run_ranks(mode, round_folder, settings, ["--steps", str(settings.steps)])[0]
                       for mode in order}
            check_losses(records)
            separate.append({"order": list(order), **separate_round(records, settings)})
            line = (f"reduction: round {index + 1}/{rounds_count} ({', '.join(order)}): steps/s "
                    + ", ".join(f"{mode} {separate[-1]['steps_per_s'][mode]:.3f}" for mode in MODES)
                    + f"; overlap/no-overlap {separate[-1]['overlap_vs_no_overlap']:.3f}, "
                      f"overlap/DDP {separate[-1]['overlap_vs_ddp']:.3f}")
            if index < settings.interleaved_rounds:
                record = run_ranks("interleaved", round_folder, settings,
                                   ["--steps", str(settings.cycles), "--probe-steps", str(settings.probe_steps)])[0]
                interleaved.append(interleaved_round(record, settings))
                line += (f"; interleaved: overlap/no-overlap {interleaved[-1]['overlap_vs_no_overlap']:.3f}, "
                         f"overlap/DDP {interleaved[-1]['overlap_vs_ddp']:.3f}")
            print(line, flush=True)

    def ratios(results: list[dict[str, Any]], name: str) -> list[float]:
        return [r[name] for r in results]

    def rates_of(results: list[dict[str, Any]], mode: str) -> list[float]:
        return [r["steps_per_s"][mode] for r in results]

    def median_of(results: list[dict[str, Any]], key: str, mode: str) -> float:
        return median([r[key][mode] for r in results])

    def cpu_note(results: list[dict[str, Any]]) -> str:
        return "CPU s a step (process, every thread): " + ", ".join(
            f"{mode} {median_of(results, 'cpu_s_per_step', mode):.3f} (main thread "
            f"{median_of(results, 'main_cpu_s_per_step', mode):.3f})" for mode in MODES)

    def backward_note(results: list[dict[str, Any]]) -> str:
        return (f"last micro-batch's backward pass {median_of(results, 'last_backward_s', 'tidal-overlap'):.3f} s "
                f"with overlap, {median_of(results, 'last_backward_s', 'tidal-no-overlap'):.3f} s without; the "
                f"wait for the reduction after it {median_of(results, 'finish_s', 'tidal-overlap'):.3f} s with "
                f"overlap, {median_of(results, 'finish_s', 'tidal-no-overlap'):.3f} s without (DDP's last backward, "
                f"its reduction inside: {median_of(results, 'last_backward_s', 'ddp'):.3f} s)")

    buckets = separate[0]["buckets"]
    common = (f"{settings.parameters / 1e6:.1f} M float32 parameters ({gradient_mb:.0f} MB of gradients) in {buckets} "
              f"buckets of ≤ {settings.bucket_mb:g} MB")
    separate_note = f"{rounds_count} rounds of one run a mode, {settings.steps} steps, rate after the first " \
                    f"{settings.skip + 1}"
    probes = [r["probe"] for r in interleaved if r["probe"]]
    probe = {name: median([p[name] for p in probes]) for name in probes[0]} if probes else {}
    probe_note = ""
    if probe:
        alone = probe["micro_batch_s"] + probe["allreduce_s"]
        probe_note = (f"; probe, parts apart: one micro-batch's forward + backward {probe['micro_batch_s']:.3f} s, "
                      f"the buckets' all-reduce {probe['allreduce_s']:.3f} s (CPU {probe['allreduce_cpu_s']:.3f} s), "
                      f"both at once {probe['concurrent_s']:.3f} s against {alone:.3f} s one after the other (the "
                      f"most overlap can save on this machine: {alone - probe['concurrent_s']:+.3f} s a step), "
                      f"optimizer {probe['optimizer_s']:.3f} s")
    def row(results: list[dict[str, Any]], against: str, metric: str, baseline_name: str, pairs: str,
            note: str) -> Row:
        """Tidal with overlap against `against` ("tidal-no-overlap" or "ddp") over `results`."""
        ratio_name = "overlap_vs_no_overlap" if against == "tidal-no-overlap" else "overlap_vs_ddp"
        ratio = median(ratios(results, ratio_name))
        goal, met = (("faster: ratio > 1", ratio > 1) if against == "tidal-no-overlap"
                     else (f"≥ {DDP_GOAL:g} × DDP's steps/s", ratio >= DDP_GOAL))
        versus = "overlap / no overlap" if against == "tidal-no-overlap" else "Tidal (overlap) / DDP"
        return Row(benchmark="reduction", metric=metric, unit="steps/s",
                   tidal=median(rates_of(results, "tidal-overlap")), baseline=median(rates_of(results, against)),
                   baseline_name=baseline_name, goal=goal, met=met, tidal_samples=rates_of(results, "tidal-overlap"),
                   baseline_samples=rates_of(results, against), ratio=ratio,
                   ratio_meaning=f"{versus} steps/s (median of {pairs})", note=note)

    prefix = f"steps/s, wide MLP, world {WORLD}"
    rows = [
        row(separate, "tidal-no-overlap", f"{prefix}: DataParallel with overlapped reduction vs without",
            "DataParallel(overlap=False)", "per-round pairs",
            f"ratio {spread(ratios(separate, 'overlap_vs_no_overlap'))}; {common}; {separate_note}; "
            f"{backward_note(separate)}; {cpu_note(separate)}{probe_note}"),
        row(separate, "ddp", f"{prefix}: DataParallel (overlapped) vs plain DDP", "plain DDP (gloo, no_sync)",
            "per-round pairs",
            f"ratio {spread(ratios(separate, 'overlap_vs_ddp'))}; without overlap / DDP: "
            f"{spread(ratios(separate, 'no_overlap_vs_ddp'))}; {common}; {separate_note}"),
    ]
    if interleaved:
        cycles_note = (f"{len(interleaved)} runs of {settings.cycles} cycles (one step of each mode, order rotated), "
                       f"rate over cycles after the first {settings.cycle_skip}")

        def cycle_ratios(name: str) -> list[float]:
            return [value for r in interleaved for value in r["cycle_ratios"][name]]

        interleaved_prefix = f"{prefix}, steps interleaved in one process pair"
        rows += [
            row(interleaved, "tidal-no-overlap", f"{interleaved_prefix}: DataParallel with overlapped reduction vs "
                "without", "DataParallel(overlap=False), steps interleaved", "per-run ratios",
                f"ratio {spread(ratios(interleaved, 'overlap_vs_no_overlap'), 'per-run')}; per cycle "
                f"{spread(cycle_ratios('overlap_vs_no_overlap'), 'per-cycle')}; {common}; {cycles_note}; "
                f"{backward_note(interleaved)}; {cpu_note(interleaved)}"),
            row(interleaved, "ddp", f"{interleaved_prefix}: DataParallel (overlapped) vs plain DDP",
                "plain DDP (gloo, no_sync), steps interleaved", "per-run ratios",
                f"ratio {spread(ratios(interleaved, 'overlap_vs_ddp'), 'per-run')}; per cycle "
                f"{spread(cycle_ratios('overlap_vs_ddp'), 'per-cycle')}; without overlap / DDP: "
                f"{spread(ratios(interleaved, 'no_overlap_vs_ddp'), 'per-run')}; {common}; {cycles_note}"),
        ]
    write_result("reduction", rows, quick=args.quick,
                 settings={"world": WORLD, "model": f"MLP {settings.depth} × Linear({settings.width}, "
                                                    f"{settings.width}) + Linear({settings.width}, {OUTPUTS})",
                           "parameters": settings.parameters, "global_batch": settings.global_batch,
                           "micro_batch": settings.micro_batch, "bucket_mb": settings.bucket_mb, "buckets": buckets,
                           "steps": settings.steps, "skip": settings.skip, "rounds": rounds_count,
                           "cycles": settings.cycles, "cycle_skip": settings.cycle_skip,
                           "interleaved_runs": len(interleaved), "probe_steps": settings.probe_steps,
                           "optimizer": "SGD lr 1e-3", "threads": "OMP_NUM_THREADS=1, torch.set_num_threads(1)",
                           "interval": f"{CONFIDENCE:.0%} order-statistic interval of the median of the ratios",
                           "ratios": {name: ratios(separate, name) for name, _, _ in RATIOS},
                           "interleaved_ratios": {name: ratios(interleaved, name) for name, _, _ in RATIOS},
                           "probe_medians": probe, "separate_rounds": separate, "interleaved_rounds": interleaved})


if __name__ == "__main__":
    main()
