"""A tiny MLP regression trained with Tidal's live elasticity (`tidal.train`).

Run it under a Tidal launcher in live mode and it grows, shrinks and survives failures
in-process; run it alone (`python train_mlp.py`) and it trains in a fixed world of one,
which is the reference an elastic run reproduces: with --dtype float64 the final
parameters agree to ~1e-12 whatever the world sizes were along the way."""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import TensorDataset

from tidal.train import Elastic
from tidal.train.backend import select_device, worker_device


def make_dataset(size: int, features: int, seed: int, dtype: torch.dtype) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, features, generator=generator, dtype=torch.float64)
    weights = torch.randn(features, 1, generator=generator, dtype=torch.float64)
    targets = torch.sin(inputs @ weights) + 0.1 * torch.randn(size, 1, generator=generator, dtype=torch.float64)
    return TensorDataset(inputs.to(dtype), targets.to(dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per micro-batch (demos, tests)")
    parser.add_argument("--ledger-dir", default=None, help="write every step attempt and commit here")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: this worker's GPU (LOCAL_RANK's among those it sees), NCCL between workers")
    args = parser.parse_args()

    # Chosen and made current before anything touches CUDA.
    device = select_device(worker_device(os.environ, "nccl")) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    dataset = make_dataset(args.samples, 16, args.seed, dtype)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(dtype)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        inputs, targets = (tensor.to(device) for tensor in batch)
        if args.step_time:
            time.sleep(args.step_time)
        return torch.nn.functional.mse_loss(model(inputs), targets, reduction="sum")

    job = Elastic(model, optimizer, dataset, loss_fn=loss_fn, global_batch=args.global_batch,
                  micro_batch=args.micro_batch, lr_scheduler=scheduler, seed=args.seed,
                  checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                  ledger_dir=args.ledger_dir)
    for result in job.train(args.steps):
        if result.rank == 0 and (result.step % 20 == 0 or result.step == args.steps):
            print(f"step {result.step} loss {result.loss:.6f} world {result.world_size} generation {result.generation}",
                  flush=True)
    if job.rank == 0 and args.out:
        torch.save({"model": {name: value.cpu() for name, value in model.state_dict().items()}, "step": job.step},
                   args.out)


if __name__ == "__main__":
    main()
