"""A training script written for torchrun, with nothing of Tidal in it.

It reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT through `init_process_group`'s
env:// rendezvous, trains a small MLP with DDP on gloo, and resumes from its own snapshot
(written atomically by rank 0 every few steps). Under Tidal's restart mode it runs
unmodified: each world change stops it and starts it again with the new environment.

    torchrun --nproc-per-node 2 train_snapshot.py --snapshot /tmp/snap.pt
    tidal submit --mode restart -- python train_snapshot.py --snapshot /shared/snap.pt

With --log-dir, every rank appends one JSON line per step to <log-dir>/rank-<pid>.jsonl
(rank, world size, step, loss, time): the tests read these to see who trained when.

With --simulate-accelerator NAME (and the other --simulated-* flags of
`tidal.train.simulated`) each step also spends the device time of its share of the batch
and the time of its gradient all-reduce as that accelerator and link would, in sleeps;
only then does the script import anything of Tidal."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from tidal.train.simulated import SimulatedDevice


def batch_for(step: int, rank: int, world_size: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch `step` (a fixed function of the step, so a
    resumed run sees the same data)."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(global_batch, 16, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(global_batch, 1, generator=generator)
    share = torch.arange(global_batch).tensor_split(world_size)[rank]
    return inputs[share], targets[share]


def save_snapshot(path: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    temporary = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, temporary)
    os.replace(temporary, path)


def main() -> None:
    parser = argparse.ArgumentParser(epilog="--simulate-accelerator NAME and the other --simulated-* flags of "
                                            "tidal.train.simulated run the steps on a simulated accelerator")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it)")
    parser.add_argument("--log-dir", type=Path)
    args, simulation_flags = parser.parse_known_args()
    device: SimulatedDevice | None = None
    if simulation_flags:
        from tidal.train.simulated import SimulatedDevice, parse_arguments

        simulation = parse_arguments(simulation_flags)
        device = SimulatedDevice(simulation) if simulation is not None else None

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    if args.snapshot.exists():
        snapshot = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        start = snapshot["step"]
    ddp = DistributedDataParallel(model)
    log_file = None
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(args.log_dir / f"rank-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    for step in range(start, args.steps):
        started = time.monotonic()
        inputs, targets = batch_for(step, rank, world_size, args.global_batch)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(inputs), targets)
        loss.backward()
        if device is not None:
            # One micro-batch a step, its gradients all-reduced across every rank (each a replica).
            device.finish_micro_batch(len(inputs), started)
            device.reduce(world_size)
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if log_file is not None:
            log_file.write(json.dumps({"rank": rank, "world_size": world_size, "step": step + 1, "loss": loss.item(),
                                       "time": time.time(), "pid": os.getpid(),
                                       "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}) + "\n")
        if rank == 0 and (step + 1) % args.snapshot_every == 0:
            save_snapshot(args.snapshot, step + 1, model, optimizer)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
