"""Where every sample goes: one seeded global order and a fixed global batch.

The job's samples come in a global order: data epoch e is a permutation of the dataset
drawn from a generator seeded with `seed + e`, and the orders of successive data epochs
follow one another. A position p in that stream is sample `perm_{p // N}[p % N]`. Step k
of a job with global batch B consumes positions `[kB, (k+1)B)` whatever the world size;
rank r of n takes a contiguous share of that range (shares differ by at most one sample)
and works through it in micro-batches. A world change between steps therefore neither
skips nor repeats a sample: the next step starts at the same position in any world."""

from __future__ import annotations

import dataclasses

import torch


class GlobalOrder:
    """The seeded order of a dataset of `size` samples, endless across data epochs."""

    def __init__(self, size: int, seed: int) -> None:
        if size <= 0:
            raise ValueError(f"the dataset is empty (size {size})")
        self.size = size
        self.seed = seed
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def permutation(self, data_epoch: int) -> torch.Tensor:
        if data_epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + data_epoch)
            self._permutation = torch.randperm(self.size, generator=generator)
            self._epoch = data_epoch
        return self._permutation

    def samples(self, start: int, count: int) -> list[int]:
        """Sample indices at positions [start, start + count) of the stream."""
        indices: list[int] = []
        position = start
        end = start + count
        while position < end:
            data_epoch, offset = divmod(position, self.size)
            take = min(end - position, self.size - offset)
            indices.extend(self.permutation(data_epoch)[offset:offset + take].tolist())
            position += take
        return indices


def share_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of `total` items among `world_size` ranks;
    the first `total % world_size` ranks take one more."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def micro_batches(indices: list[int], micro_batch: int) -> list[list[int]]:
    """`indices` cut into consecutive pieces of at most `micro_batch`."""
    if micro_batch <= 0:
        raise ValueError(f"micro_batch must be positive, not {micro_batch}")
    return [indices[i:i + micro_batch] for i in range(0, len(indices), micro_batch)]


@dataclasses.dataclass(frozen=True)
class StepSamples:
    """What one rank consumes in one step."""

    step: int
    # Position of the step's first sample in the global order.
    start: int
    global_batch: int
    # Every sample index of the step, all ranks together (what the step must consume).
    step_indices: list[int]
    # This rank's share of them.
    indices: list[int]


def step_samples(order: GlobalOrder, *, step: int, start: int, global_batch: int, rank: int,
                 world_size: int) -> StepSamples:
    step_indices = order.samples(start, global_batch)
    first, last = share_bounds(global_batch, rank, world_size)
    return StepSamples(step=step, start=start, global_batch=global_batch, step_indices=step_indices,
                       indices=step_indices[first:last])
