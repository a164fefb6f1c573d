"""`tidal.train`: what a training script imports to train elastically under Tidal.

    from tidal.train import Elastic, DataParallel, HybridSharded

`Elastic` runs the loop (fixed global batch, exact per-sample accounting, world changes in
process); a strategy says how a replica computes and reduces its gradients: `DataParallel`
(every worker a full replica, gradients reduced in buckets during the backward pass) or
`HybridSharded` (FSDP2 over the workers of a unit, replicated across units). The launcher
(`tidal.launcher`) only runs and watches the processes; it does not import this package."""

# First: structlog imported with rich hidden (`tidal.controller.logs`), which takes 0.15 s
# off every worker's start (a grow waits for it); the modules below import structlog.
import tidal.controller.logs  # noqa: F401
from tidal.train.elastic import (
    AccountingError,
    Elastic,
    FixedBatch,
    ScaledBatch,
    StateLost,
    StateMismatch,
    StepResult,
    WorldBroken,
)
from tidal.train.progress import report_progress
from tidal.train.strategy import DataParallel, HybridSharded, Strategy

__all__ = ["AccountingError", "DataParallel", "Elastic", "FixedBatch", "HybridSharded", "ScaledBatch", "StateLost",
           "StateMismatch", "StepResult", "Strategy", "WorldBroken", "report_progress"]
