"""tidal-launcher: the per-unit agent, and the worker library training scripts import."""
