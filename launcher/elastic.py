"""Moved: the worker library is `tidal.train` now (the launcher no longer hosts it). This
alias keeps scripts written against `tidal.launcher.elastic` running for one release."""

import warnings

from tidal.train.elastic import *  # noqa: F403
from tidal.train.elastic import Elastic, FixedBatch, ScaledBatch, StepResult  # noqa: F401

warnings.warn("tidal.launcher.elastic moved to tidal.train; import Elastic from tidal.train", DeprecationWarning,
              stacklevel=2)
