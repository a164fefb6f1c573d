"""Simulated accelerators (`tidal.train.simulated`): the sizes and times of the stated
model, where `Elastic` spends them, and that they change nothing of what it computes."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import TensorDataset

from tidal.train.elastic import Elastic
from tidal.train.simulated import (
    ACCELERATORS,
    INFINIBAND_NDR,
    Link,
    SimulatedDevice,
    Simulation,
    compute_seconds,
    micro_batch_flops,
    parse_arguments,
    ring_all_reduce_seconds,
)

H100_1B = Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=4096)


def test_the_stated_sizes_and_times() -> None:
    assert micro_batch_flops(1e9, 2048) == 6 * 1e9 * 2048
    assert compute_seconds(989e12 * 0.4, 989e12, 0.4) == pytest.approx(1.0)
    # A ring all-reduce sends 2 (n - 1) / n of the data per rank; nothing for one rank.
    assert ring_all_reduce_seconds(2e9, 1, 50e9) == 0.0
    assert ring_all_reduce_seconds(2e9, 2, 50e9) == pytest.approx(0.04)
    assert ring_all_reduce_seconds(2e9, 4, 50e9) == pytest.approx(0.06)
    assert INFINIBAND_NDR.bytes_per_s == 50e9
    # 16 samples of 4096 tokens of a 1B model on an H100 at 40 % of 989 TFLOP/s: 0.9935 s.
    assert H100_1B.micro_batch_seconds(16) == pytest.approx(6 * 1e9 * 16 * 4096 / (989e12 * 0.4))
    assert H100_1B.micro_batch_seconds(8) == pytest.approx(H100_1B.micro_batch_seconds(16) / 2)
    # BF16 gradients of 1B parameters (2 GB) over 400 Gb/s; a shard of a replica reduces its part.
    assert H100_1B.reduction_seconds(4) == pytest.approx(0.06)
    assert H100_1B.reduction_seconds(4, shard_size=2) == pytest.approx(0.03)
    assert H100_1B.reduction_seconds(1) == 0.0


def test_bad_rates_are_named_and_the_flags_make_the_simulation() -> None:
    with pytest.raises(ValueError, match="utilisation"):
        Simulation(accelerator=ACCELERATORS["h100"], parameters=1e9, tokens_per_sample=1, mfu=1.5)
    with pytest.raises(ValueError, match="parameters"):
        Simulation(accelerator=ACCELERATORS["h100"], parameters=0, tokens_per_sample=1)
    assert parse_arguments([]) is None
    assert parse_arguments(["--simulate-accelerator", "h100"]) == H100_1B
    custom = parse_arguments(["--simulate-accelerator", "a100", "--simulated-params", "8e9", "--simulated-mfu", "0.5",
                              "--simulated-tokens-per-sample", "1", "--simulated-link-gbps", "200"])
    assert custom == Simulation(accelerator=ACCELERATORS["a100"], parameters=8e9, tokens_per_sample=1, mfu=0.5,
                                link=Link("200 Gb/s", 25e9))
    with pytest.raises(SystemExit):
        parse_arguments(["--simulate-accelerator", "h100", "--not-a-flag"])


def test_a_micro_batch_sleeps_only_what_its_real_passes_left_of_its_device_time() -> None:
    slept: list[float] = []
    device = SimulatedDevice(H100_1B, sleep=slept.append)
    full = H100_1B.micro_batch_seconds(16)
    # Real passes that took 0.25 s count toward the device time.
    assert device.finish_micro_batch(16, started=time.monotonic() - 0.25) == pytest.approx(full - 0.25, abs=0.01)
    # Real passes longer than the device time: nothing to sleep.
    assert device.finish_micro_batch(16, started=time.monotonic() - 10.0) == 0.0
    assert device.reduce(1) == 0.0
    assert device.reduce(2) == pytest.approx(0.04)
    assert len(slept) == 2 and slept[1] == pytest.approx(0.04)
    assert device.device_s == pytest.approx(2 * full) and device.reduction_s == pytest.approx(0.04)


def _train(simulation: Simulation | None) -> tuple[Elastic, float]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(40, 3, generator=generator, dtype=torch.float64)
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1], reduction="sum")

    job = Elastic(model, optimizer, dataset, loss_fn=loss_fn, global_batch=12, micro_batch=4, seed=3,
                  simulation=simulation)
    started = time.monotonic()
    for _ in job.train(5):
        pass
    return job, time.monotonic() - started


def test_elastic_spends_each_micro_batchs_device_time_and_computes_the_same_bits() -> None:
    # 4 samples of a 20M-parameter model's 4096-token sequences on an A100 at 40 %: 0.016 s a micro-batch.
    simulation = Simulation(accelerator=ACCELERATORS["a100"], parameters=2e7, tokens_per_sample=4096)
    assert simulation.micro_batch_seconds(4) == pytest.approx(0.01575, rel=1e-3)
    plain, plain_s = _train(None)
    simulated, simulated_s = _train(simulation)
    device_s = 5 * 3 * simulation.micro_batch_seconds(4)
    assert simulated.simulated is not None and plain.simulated is None
    assert simulated.simulated.device_s == pytest.approx(device_s)
    # A world of one replica has no reduction to spend.
    assert simulated.simulated.reduction_s == 0.0
    assert simulated_s >= device_s
    assert plain_s < device_s
    for a, b in zip(plain.parts.model.parameters(), simulated.parts.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert simulated.counters == plain.counters
