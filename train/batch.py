"""Batch policies: how the global batch B (and the learning rate with it) follows the
world size. `Elastic` applies the policy each time a world forms."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal


@dataclasses.dataclass(frozen=True)
class FixedBatch:
    """The default: the global batch B is the job's, whatever the world size."""

    global_batch: int

    def batch_for(self, world_size: int) -> int:
        return self.global_batch

    def lr_factor(self, world_size: int) -> float:
        return 1.0


@dataclasses.dataclass(frozen=True)
class ScaledBatch:
    """For users who want it: B follows the world size (`per_rank` samples a rank), and the
    learning rate follows B by a rule relative to `reference_world_size`: "linear" (Goyal
    et al.), "sqrt", or "none". An elastic run then no longer computes what a fixed-size
    run computes."""

    per_rank: int
    lr_rule: Literal["linear", "sqrt", "none"] = "linear"
    reference_world_size: int = 1

    def batch_for(self, world_size: int) -> int:
        return self.per_rank * world_size

    def lr_factor(self, world_size: int) -> float:
        ratio = world_size / self.reference_world_size
        return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[self.lr_rule]


BatchPolicy = FixedBatch | ScaledBatch
