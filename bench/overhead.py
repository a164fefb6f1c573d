"""Overhead: steps/s of the example language model trained by Tidal's live mode (a
controller, two launchers, the worker library, world fixed at 2) against the same model
in a plain torch.distributed script (DDP under torchrun, 2 ranks), in the same run,
alternating; and torchft 0.2.0 (when installed) with 2 replica groups on the same model.
Goal: Tidal within 2% of plain DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.common import DDP_BASELINE, LM_EXAMPLE, Row, median, parser, read_jsonl, steady_rate, workspace, write_result
from bench.live import commit_times, run_fixed_world
from bench.torchft_job import TorchftJob, torchft_lighthouse, torchft_name

WORLD = 2
MODEL = ["--global-batch", "32", "--micro-batch", "16", "--context", "64", "--width", "64", "--layers", "2"]


def tidal_steps_per_second(folder: Path, steps: int, skip: int) -> float:
    ledger = folder / "ledger"
    run_fixed_world(folder, [sys.executable, str(LM_EXAMPLE), "--steps", str(steps), "--log-every", "1000",
                             "--ledger-dir", str(ledger), *MODEL], WORLD, "overhead")
    commits = commit_times(ledger, WORLD)
    assert len(commits) >= steps - 1, f"only {len(commits)} steps committed at world size {WORLD}"
    return steady_rate(commits, skip)


def baseline_steps_per_second(folder: Path, steps: int, skip: int) -> float:
    logs = folder / "ddp-log"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
                    str(DDP_BASELINE), "--steps", str(steps), "--log-dir", str(logs), *MODEL],
                   check=True, capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    times = [r["time"] for r in read_jsonl(sorted(logs.glob("*.jsonl"))) if r["rank"] == 0]
    return steady_rate(times, skip)


def torchft_steps_per_second(folder: Path, steps: int, skip: int, lighthouse: Path) -> float:
    """torchft with WORLD replica groups on the same model and global batch."""
    with TorchftJob(folder, lighthouse, WORLD, MODEL, steps=steps) as job:
        job.wait_done(600)
        times = [r["time"] for r in job.steps(0) if r["replica"] == 0]
    return steady_rate(times, skip)


def main() -> None:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    repeat = args.repeat or (1 if args.quick else 5)
    steps, skip = (40, 10) if args.quick else (400, 50)
    tidal, baseline, peer = [], [], []
    lighthouse = torchft_lighthouse()
    if lighthouse is None:
        print("overhead: torchft is not installed here (pip install torchft==0.2.0): its row is left out", flush=True)
    with workspace(args.keep, "overhead") as folder:
        for index in range(repeat):
            baseline.append(baseline_steps_per_second(folder / f"baseline-{index}", steps, skip))
            tidal.append(tidal_steps_per_second(folder / f"tidal-{index}", steps, skip))
            if lighthouse is not None:
                peer.append(torchft_steps_per_second(folder / f"torchft-{index}", steps, skip, lighthouse))
            print(f"overhead: repetition {index + 1}: Tidal {tidal[-1]:.2f} steps/s, plain DDP {baseline[-1]:.2f}"
                  + (f", torchft {peer[-1]:.2f}" if peer else ""), flush=True)
    # Per-pair ratios cancel slow drifts of this shared machine; the row reports their median.
    ratios = [t / b for t, b in zip(tidal, baseline, strict=True)]
    slowdown = 1 - median(ratios)
    row = Row(benchmark="overhead", metric=f"steps/s, LM, world {WORLD}, live mode vs plain DDP", unit="steps/s",
              tidal=median(tidal), baseline=median(baseline), baseline_name="plain DDP under torchrun",
              goal="Tidal ≤ 2% slower", met=slowdown <= 0.02, tidal_samples=tidal, baseline_samples=baseline,
              ratio=median(ratios), ratio_meaning="Tidal / plain steps/s (median of pairs)",
              note=f"{slowdown:+.1%} slower; {steps} steps a run, rate over steps {skip}..{steps}")
    rows = [row]
    if peer:
        peer_ratios = [t / p for t, p in zip(tidal, peer, strict=True)]
        peer_vs_ddp = median([p / b for p, b in zip(peer, baseline, strict=True)])
        rows.append(Row(benchmark="overhead", metric=f"steps/s, LM, world {WORLD}, live mode vs torchft",
                        unit="steps/s", tidal=median(tidal), baseline=median(peer), baseline_name=torchft_name("ddp"),
                        goal="reported (no goal)", met=True, tidal_samples=tidal, baseline_samples=peer,
                        ratio=median(peer_ratios), ratio_meaning="Tidal / torchft steps/s (median of pairs)",
                        note=f"torchft / plain DDP steps/s {peer_vs_ddp:.3f} (median of pairs); torchft runs its "
                             "quorum with the lighthouse every step"))
    write_result("overhead", rows, quick=args.quick,
                 settings={"steps": steps, "skip": skip, "repeat": repeat, "world": WORLD, "model": " ".join(MODEL)})


if __name__ == "__main__":
    main()
