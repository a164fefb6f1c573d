"""A PyTorch Lightning DDP script written for torchrun, with nothing of Tidal in it.

A tiny regression model on random data, trained with `strategy="ddp"` on CPU. The world
comes from torchrun's environment (LOCAL_WORLD_SIZE processes on each of
GROUP_WORLD_SIZE nodes), Lightning sees the launch as torchrun's (its
TorchElasticEnvironment), and Lightning's own checkpoint (`last.ckpt`, every few steps)
is where a restart resumes from: `fit(..., ckpt_path="last")` starts from scratch when
there is none. Under Tidal's restart mode it runs unmodified: each world change stops it
and starts it again with the new environment.

    torchrun --nnodes 2 --nproc-per-node 1 ... lightning_ddp.py --checkpoint-dir /shared/ckpt
    tidal submit --mode restart --min-replicas 1 --max-replicas 2 -- \\
        python lightning_ddp.py --checkpoint-dir /shared/ckpt

It prints one line when the trainer is set up (`cluster_environment=... world_size=...`)
and, on global rank 0, one when training is over (`finished epoch=... global_step=...`)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 8
SAMPLES = 512


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.layer(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Pace(Callback):
    """Sleep after each step, so that a step takes about `step_time_s`."""

    def __init__(self, step_time_s: float) -> None:
        self.step_time_s = step_time_s

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        time.sleep(self.step_time_s)


def dataset() -> TensorDataset:
    """The same random data on every rank and in every restart."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs @ torch.linspace(-1, 1, FEATURES).unsqueeze(1)
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, help="where last.ckpt lives (shared by every node)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint-every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args()

    checkpoints = ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True,
                                  every_n_train_steps=args.checkpoint_every)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")), max_epochs=args.epochs,
                        callbacks=[checkpoints, Pace(args.step_time)], default_root_dir=args.checkpoint_dir,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    print(f"cluster_environment={type(trainer.strategy.cluster_environment).__name__} "
          f"rank={trainer.global_rank} world_size={trainer.world_size} pid={os.getpid()}", flush=True)
    trainer.fit(Regression(), DataLoader(dataset(), batch_size=args.batch_size, shuffle=True), ckpt_path="last")
    if trainer.is_global_zero:
        print(f"finished epoch={trainer.current_epoch} global_step={trainer.global_step} "
              f"world_size={trainer.world_size}", flush=True)


if __name__ == "__main__":
    main()
