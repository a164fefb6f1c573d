"""Simulated accelerators: a tiny model trained on CPU that keeps the time of a big one on GPUs.

On a machine without accelerators, N worker processes fight over the host's few cores, so
a bigger world runs slower and says nothing about how Tidal scales. With a simulation each
worker still trains its real (small) model, whose numerics and per-sample accounting stay
exactly what they are, and in addition spends the time a stated accelerator would take
for a stated model, in `time.sleep`, which uses no CPU (and releases the GIL). N replicas
then give N times the throughput, less what the gradient reduction costs, as on a real
cluster.

The model, stated once:

- **Compute.** A micro-batch of `s` samples of `tokens_per_sample` tokens each costs
  `6 × parameters × s × tokens_per_sample` FLOPs (2 for the forward pass and 4 for the
  backward pass per parameter and token: the usual dense-transformer estimate, attention's
  own FLOPs left out). The accelerator runs them at `peak_flops × mfu` (dense peak, e.g. an
  H100 SXM's 989 TFLOP/s in BF16, times the model FLOPs utilisation, 0.4 by default). A
  micro-batch takes at least that long: what its real forward and backward passes took
  counts toward it (the host's work overlaps the device's, as CUDA's asynchronous
  launches do), and the rest is slept after its backward pass.
- **Reduction.** Once per step, the gradient all-reduce across the step's `n` replicas
  adds the time of a ring all-reduce, `2 (n − 1) / n × gradient bytes / link bandwidth`,
  with gradient bytes = `parameters × gradient_bytes_per_parameter` (BF16: 2) divided by
  the workers of a replica (each reduces its shard across replicas), and the link's
  bandwidth per rank (InfiniBand NDR, 400 Gb/s = 50 GB/s, by default). It is added in full,
  not overlapped with the backward pass (a real DDP hides part of it): an upper bound on
  the reduction's cost. A world of one replica has no reduction time. The real (small)
  collective still runs. Collectives within a replica (FSDP's, over NVLink) are not
  modelled.

`Simulation` holds the stated rates and sizes and computes the times (pure);
`SimulatedDevice` spends them, in one place. `Elastic(..., simulation=...)` applies them
around its own step; a script with its own loop calls `SimulatedDevice` itself (see
examples/restart_mode/train_snapshot.py). The examples take the command-line flags
`add_arguments` defines (`--simulate-accelerator h100 --simulated-params 1e9 ...`)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence

# FLOPs per parameter per token of a training step: 2 in the forward pass, 4 in the backward.
TRAINING_FLOPS_PER_PARAMETER_TOKEN = 6
DEFAULT_MFU = 0.4


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator's dense peak rate (no sparsity) in the precision training uses."""

    name: str
    peak_flops: float


@dataclasses.dataclass(frozen=True)
class Link:
    """The network bandwidth each rank has for the cross-replica gradient all-reduce."""

    name: str
    bytes_per_s: float


# Vendor data sheets, dense (not 2:4 sparse) BF16 tensor-core peaks per GPU.
ACCELERATORS: dict[str, Accelerator] = {
    "a100": Accelerator("NVIDIA A100 SXM, dense BF16", 312e12),
    "h100": Accelerator("NVIDIA H100 SXM, dense BF16", 989e12),
    "b200": Accelerator("NVIDIA B200, dense BF16", 2250e12),
}
INFINIBAND_NDR = Link("InfiniBand NDR, 400 Gb/s", 400e9 / 8)


def micro_batch_flops(parameters: float, tokens: float) -> float:
    """FLOPs of training `tokens` tokens of a dense model of `parameters` parameters:
    6 × parameters × tokens."""
    return TRAINING_FLOPS_PER_PARAMETER_TOKEN * parameters * tokens


def compute_seconds(flops: float, peak_flops: float, mfu: float) -> float:
    """Seconds an accelerator of dense peak `peak_flops` running at utilisation `mfu` takes
    for `flops`."""
    return flops / (peak_flops * mfu)


def ring_all_reduce_seconds(nbytes: float, replicas: int, bytes_per_s: float) -> float:
    """Seconds a ring all-reduce of `nbytes` over `replicas` ranks takes when each rank
    sends and receives at `bytes_per_s`: each sends 2 (n − 1) / n of the data. Zero for a
    single rank."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * nbytes / bytes_per_s


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The stated rates and sizes: `accelerator` at `mfu`, a simulated dense model of
    `parameters` parameters whose samples are `tokens_per_sample` tokens each (1 for a
    model that is not a sequence model: a sample is then one input), gradients of
    `gradient_bytes_per_parameter` bytes reduced over `link`."""

    accelerator: Accelerator
    parameters: float
    tokens_per_sample: int
    mfu: float = DEFAULT_MFU
    link: Link = INFINIBAND_NDR
    gradient_bytes_per_parameter: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"a model FLOPs utilisation is in (0, 1], not {self.mfu}")
        for name in ("parameters", "tokens_per_sample", "gradient_bytes_per_parameter"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.accelerator.peak_flops <= 0 or self.link.bytes_per_s <= 0:
            raise ValueError("an accelerator's rate and a link's bandwidth must be positive")

    def micro_batch_seconds(self, samples: int) -> float:
        """The device time of a micro-batch of `samples` samples."""
        flops = micro_batch_flops(self.parameters, samples * self.tokens_per_sample)
        return compute_seconds(flops, self.accelerator.peak_flops, self.mfu)

    def reduction_seconds(self, replicas: int, shard_size: int = 1) -> float:
        """The gradient all-reduce's time across `replicas` replicas, for a worker holding
        1 / `shard_size` of the gradients."""
        nbytes = self.parameters * self.gradient_bytes_per_parameter / shard_size
        return ring_all_reduce_seconds(nbytes, replicas, self.link.bytes_per_s)

    def describe(self) -> str:
        return (f"{self.accelerator.name} ({self.accelerator.peak_flops / 1e12:g} TFLOP/s) at MFU {self.mfu:g}, "
                f"a {self.parameters / 1e9:g}B-parameter model, {self.tokens_per_sample} tokens a sample "
                f"(6 × parameters × tokens FLOPs), {self.gradient_bytes_per_parameter}-byte gradients ring-all-reduced "
                f"over {self.link.name} ({self.link.bytes_per_s / 1e9:g} GB/s a rank)")


class SimulatedDevice:
    """Spends a `Simulation`'s times, every one through `_spend` (by default
    `time.sleep`, which uses no CPU), and keeps their totals."""

    def __init__(self, simulation: Simulation, sleep: Callable[[float], None] = time.sleep) -> None:
        self.simulation = simulation
        self._sleep = sleep
        self.device_s = 0.0
        self.reduction_s = 0.0

    def finish_micro_batch(self, samples: int, started: float) -> float:
        """After a micro-batch's backward pass: wait out the rest of its device time, counted
        from `started` (time.monotonic() when the micro-batch began). Returns the seconds slept."""
        device_s = self.simulation.micro_batch_seconds(samples)
        self.device_s += device_s
        return self._spend(device_s - (time.monotonic() - started))

    def reduce(self, replicas: int, shard_size: int = 1) -> float:
        """Once per step, with the gradient reduction: its time over `replicas` replicas.
        Returns the seconds slept (0 in a world of one replica)."""
        reduction_s = self.simulation.reduction_seconds(replicas, shard_size)
        self.reduction_s += reduction_s
        return self._spend(reduction_s)

    def _spend(self, seconds: float) -> float:
        if seconds <= 0:
            return 0.0
        self._sleep(seconds)
        return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line flags of a simulated accelerator (off unless --simulate-accelerator)."""
    group = parser.add_argument_group("simulated accelerators (tidal.train.simulated)")
    group.add_argument("--simulate-accelerator", choices=sorted(ACCELERATORS), default=None,
                       help="spend each micro-batch's device time and each step's all-reduce time as this "
                            "accelerator and link would, in sleeps on top of the real (small) model")
    group.add_argument("--simulated-params", type=float, default=1e9,
                       help="parameters of the simulated model (default 1e9)")
    group.add_argument("--simulated-tokens-per-sample", type=int, default=4096,
                       help="tokens a sample stands for (1 for a model that is not a sequence model; default 4096)")
    group.add_argument("--simulated-mfu", type=float, default=DEFAULT_MFU,
                       help=f"model FLOPs utilisation of the accelerator's dense peak (default {DEFAULT_MFU})")
    group.add_argument("--simulated-link-gbps", type=float, default=INFINIBAND_NDR.bytes_per_s * 8 / 1e9,
                       help="link bandwidth per rank in Gbit/s for the gradient all-reduce (default 400: "
                            "InfiniBand NDR)")
    group.add_argument("--simulated-gradient-bytes", type=int, default=2,
                       help="bytes per gradient element (default 2: BF16)")


def from_arguments(arguments: argparse.Namespace) -> Simulation | None:
    """The simulation the flags of `add_arguments` ask for; None without --simulate-accelerator."""
    if arguments.simulate_accelerator is None:
        return None
    gbps = arguments.simulated_link_gbps
    link = INFINIBAND_NDR if gbps * 1e9 / 8 == INFINIBAND_NDR.bytes_per_s else Link(f"{gbps:g} Gb/s", gbps * 1e9 / 8)
    return Simulation(accelerator=ACCELERATORS[arguments.simulate_accelerator], parameters=arguments.simulated_params,
                      tokens_per_sample=arguments.simulated_tokens_per_sample, mfu=arguments.simulated_mfu, link=link,
                      gradient_bytes_per_parameter=arguments.simulated_gradient_bytes)


def parse_arguments(argv: Sequence[str]) -> Simulation | None:
    """`from_arguments` over `argv` alone (for a script that parses its own flags first and
    hands the rest here); an unknown flag is an error."""
    parser = argparse.ArgumentParser(prog="simulated accelerator", add_help=False)
    add_arguments(parser)
    return from_arguments(parser.parse_args(list(argv)))
