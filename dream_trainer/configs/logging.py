"""What is logged, how often, and where local log files go."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PositiveInt

from dream_trainer.configs.base import ConfigModel


class LoggingParameters(ConfigModel):
    """Logging cadence and location, shared by every logger mixin."""

    enabled: bool = True
    """Log at all (rank 0 only, always)."""
    log_every_n_steps: PositiveInt = 10
    """Log training step results every N optimizer steps (a host sync when logging). A logged
    value is the whole step's: averaged over its micro-batches and data-parallel ranks."""
    unreduced_keys: list[str] = Field(default_factory=list)
    """Result keys logged as they are on rank 0 for the step's last micro-batch, not averaged
    over the step: a per-rank diagnostic, say."""
    log_dir: Path = Path("outputs")
    """Logs go to ``<log_dir>/<project>/<group>/<experiment>/logs/``."""
    histogram_bins: PositiveInt = 64
    """Equal-width bins of the histograms ``log_histogram`` records (``Histograms`` callback)."""
    memory_snapshot_on_oom: bool = False
    """On CUDA, record the caching allocator's history from the end of setup (every allocation
    pays for a stack trace), and when ``fit()`` fails with an out-of-memory error write it to
    ``<logs>/memory_snapshot_rank<R>.pickle`` for https://pytorch.org/memory_viz. Elsewhere
    there is no such history: a warning says so and nothing is recorded."""


class LoggingConfigMixin(ConfigModel):
    """Adds ``logging_parameters``: the base of every logger's config mixin, so that a config
    composing several loggers has the field once."""

    logging_parameters: LoggingParameters = Field(default_factory=LoggingParameters)
    """Logging cadence and location, shared by every logger of the run."""
