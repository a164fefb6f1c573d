"""Moved: `report_progress` lives in `tidal.train.progress` now. This alias keeps scripts
written against `tidal.launcher.progress` running for one release."""

import warnings

from tidal.train.progress import report_progress

__all__ = ["report_progress"]

warnings.warn("tidal.launcher.progress moved to tidal.train.progress", DeprecationWarning, stacklevel=2)
