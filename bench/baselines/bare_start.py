"""The irreducible part of a worker's start, for bench/grow.py: a bare Python process that
imports torch and builds what examples/live_mode/train_mlp.py builds before it hands over
to Tidal (its data set, model, optimizer and scheduler), then exits. No Tidal import, no
control channel, no rendezvous."""

from __future__ import annotations

import torch


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(500, 16, generator=generator, dtype=torch.float64)
    weights = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    targets = torch.sin(inputs @ weights) + 0.1 * torch.randn(500, 1, generator=generator, dtype=torch.float64)
    dataset = torch.utils.data.TensorDataset(inputs.float(), targets.float())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    assert len(dataset) == 500


if __name__ == "__main__":
    main()
