"""Batch policies: how the global batch B (and the learning rate with it) follows the
world size. `Elastic` applies the policy each time a world forms."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

# Where a parameter group keeps the learning-rate factor its lr holds now: it travels with
# the optimizer's state (a joiner's, a checkpoint's), so the next world scales from it.
LR_FACTOR_KEY = "tidal_lr_factor"


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


def scale_learning_rates(optimizer: Any, scheduler: Any, factor: float) -> None:
    """Make each parameter group's learning rate hold `factor` (`ScaledBatch.lr_factor` of
    the world just formed) in place of the one it holds (`LR_FACTOR_KEY`, 1 at first): its
    `lr`, the `initial_lr` schedulers start from, and the scheduler's `base_lrs` are scaled
    by their ratio. A scheduler's decay so far is kept (StepLR's, cosine's), and one that
    recomputes lr from its base_lrs (LambdaLR) keeps the factor. Other values a scheduler
    keeps (OneCycleLR's max_lr, CyclicLR's bounds) are not scaled."""
    ratios = [factor / float(group.get(LR_FACTOR_KEY, 1.0)) for group in optimizer.param_groups]
    for group, ratio in zip(optimizer.param_groups, ratios, strict=True):
        group["lr"] = group["lr"] * ratio
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * ratio
        group[LR_FACTOR_KEY] = factor
    # New lists, not changed in place: a scheduler's state_dict() hands out its own (a copy
    # taken of it, or a scheduler that loaded it, would change with it).
    base_lrs = getattr(scheduler, "base_lrs", None)
    if isinstance(base_lrs, list) and len(base_lrs) == len(ratios):
        scheduler.base_lrs = [base * ratio for base, ratio in zip(base_lrs, ratios, strict=True)]
    if isinstance(getattr(scheduler, "_last_lr", None), list):
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
