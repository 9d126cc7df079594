"""``LoggerMixin``: when and what to log; ``JSONLoggerMixin``: a local backend needing nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from pydantic import Field

from dream_trainer.configs.base import ConfigModel
from dream_trainer.configs.logging import LoggingParameters
from dream_trainer.trainer.abstract import AbstractTrainer


class LoggerMixin(AbstractTrainer):
    """The logging cadence, on global rank 0 only, for any number of backends.

    Every ``log_every_n_steps`` optimizer steps the training step's scalar results are logged
    with ``trainer/global_step`` and ``trainer/epoch`` (learning rates come from the
    ``LRMonitor`` callback, which logs through ``log_dict``); epoch results are logged after each training epoch (as
    ``train_epoch/<key>``) and validation pass (under their own keys). Backends override
    ``start_logging``, ``log_dict``, ``log_config`` and ``finish`` and call ``super()``, so
    several backend mixins on one trainer all receive everything.
    """

    @property
    def logging_parameters(self) -> LoggingParameters:
        return self.config.logging_parameters  # type: ignore[attr-defined,no-any-return]

    @property
    def log_dir(self) -> Path:
        """``<log_dir>/<project>/<group>/<experiment>/logs``."""
        config = self.config
        return (Path(self.logging_parameters.log_dir) / config.project / config.group
                / config.experiment / "logs")

    @property
    def _logging(self) -> bool:
        return self.logging_parameters.enabled and self.world.is_rank_zero

    # -- backend interface ---------------------------------------------------------------------
    def start_logging(self) -> None:
        """Open the backend's run (rank 0, once, at the end of setup)."""

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        """Record scalar ``values`` at ``step`` (the global step when None)."""

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run's configuration."""

    def finish(self) -> None:
        """Flush and close the backend's run."""

    # -- cadence -------------------------------------------------------------------------------
    def post_setup(self) -> None:
        super().post_setup()
        if self._logging:
            self.start_logging()
            self.log_config(json.loads(self.config.model_dump_json()))

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)
        if (not self._logging or self.is_accumulating_gradients
                or self.global_step % self.logging_parameters.log_every_n_steps):
            return
        values = _scalars(result)
        values["trainer/global_step"] = float(self.global_step)
        values["trainer/epoch"] = float(self.current_epoch)
        self.log_dict(values, self.global_step)

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        super().post_train_epoch(result)
        if self._logging:
            self.log_dict({f"train_epoch/{k}": v for k, v in _scalars(result).items()},
                          self.global_step)

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if self._logging and not self.sanity_checking:
            self.log_dict(_scalars(result), self.global_step)

    def post_fit(self) -> None:
        super().post_fit()
        if self._logging:
            self.finish()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._logging:
            self.finish()


def _scalars(result: Mapping[str, Any]) -> dict[str, float]:
    """The one-element tensors and numbers of a result, as floats (a host sync)."""
    values = {}
    for key, value in result.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            values[key] = float(value.detach())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values[key] = float(value)
    return values


class JSONLoggerConfigMixin(ConfigModel):
    """Adds ``logging_parameters`` for ``JSONLoggerMixin``."""

    logging_parameters: LoggingParameters = Field(default_factory=LoggingParameters)
    """Logging cadence and location."""


class JSONLoggerMixin(LoggerMixin):
    """Logs to ``<log_dir>/.../logs/metrics.jsonl``, one ``{"step": N, ...}`` object a line.

    Needs no package or account; a resumed run appends to the same file, so steps keep
    increasing. The config is written to ``logs/config.json``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._json_file: IO[str] | None = None

    def start_logging(self) -> None:
        super().start_logging()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._json_file = open(self.log_dir / "metrics.jsonl", "a")

    def log_dict(self, values: Mapping[str, float], step: int | None = None) -> None:
        super().log_dict(values, step)
        if self._json_file is not None:
            record = {"step": self.global_step if step is None else step, **values}
            self._json_file.write(json.dumps(record) + "\n")
            self._json_file.flush()

    def log_config(self, config: dict[str, Any]) -> None:
        super().log_config(config)
        (self.log_dir / "config.json").write_text(json.dumps(config, indent=2))

    def finish(self) -> None:
        super().finish()
        if self._json_file is not None:
            self._json_file.close()
            self._json_file = None
