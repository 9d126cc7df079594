"""What ``fit()`` returns: the values a run logged, by step, by epoch and by validation pass,
and the step its final state is at."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dream_trainer.trainer.phases import runs_on

Row = dict[str, float]


@dataclass
class History:
    """The run's history, as ``fit()`` returns it on every rank.

    Each row is a dict of floats with its position: ``steps`` holds the training values
    logged at each logged optimizer step (``{"step": N, "loss": ...}``: with a logger mixin,
    every ``log_every_n_steps``, reduced over micro-batches and ranks; empty without one);
    ``epochs`` one row per training epoch (``{"epoch": E, "step": N, "train_epoch/loss": ...}``,
    the epoch's means, with the results of the validation that followed it merged in under
    their own keys); ``validations`` one row per validation pass of the run, also those every
    ``val_every_n_steps`` (``{"epoch": E, "step": N, "val_loss": ...}``; the sanity check and
    ``evaluate()`` calls are not part of it). A run resumed from a checkpoint holds the rows
    of its own ``fit()``, from the step it resumed at.

    Attributes:
        global_step: The optimizer step the final state is at (the last checkpoint's step
            when training ended there).
        epoch: The epochs completed.
    """

    global_step: int = 0
    epoch: int = 0
    steps: list[Row] = field(default_factory=list)
    epochs: list[Row] = field(default_factory=list)
    validations: list[Row] = field(default_factory=list)

    def per_step(self, key: str) -> list[float]:
        """The logged steps' values of ``key``, in order (steps without it left out)."""
        return [row[key] for row in self.steps if key in row]

    def per_epoch(self, key: str) -> list[float]:
        """The epochs' values of ``key`` (``"train_epoch/loss"``, ``"val_loss"``), in order."""
        return [row[key] for row in self.epochs if key in row]


class RecordsHistory:
    """The trainer's part that fills the history ``fit()`` returns (``BaseTrainer`` derives
    from it): rows are
    added from values the loop computes anyway, so recording costs no collective or host
    sync beyond the logged steps' and the epochs'."""

    _history: History
    """Private: ``history`` is a name a user's trainer may well give its own list."""
    global_step: int
    current_epoch: int
    sanity_checking: bool
    evaluating: bool
    training_parameters: Any

    def _record_step(self, values: Mapping[str, float], step: int) -> None:
        """Add a logged step's reduced training values (called by the logger mixin, on
        every rank)."""
        self._history.steps.append({"step": float(step), **values})

    @runs_on("post_train_epoch", after_bases=True)
    def _record_train_epoch(self, result: dict[str, Any]) -> None:
        row = {"epoch": float(self.current_epoch), "step": float(self.global_step)}
        row.update({f"train_epoch/{key}": value for key, value in floats(result).items()})
        self._history.epochs.append(row)

    @runs_on("post_val_epoch", after_bases=True)
    def _record_validation(self, result: dict[str, Any]) -> None:
        if self.sanity_checking or self.evaluating:
            return
        values = floats(result)
        self._history.validations.append(
            {"epoch": float(self.current_epoch), "step": float(self.global_step), **values})
        epochs = self._history.epochs
        if self.training_parameters.val_every_n_steps is None and epochs \
                and epochs[-1]["epoch"] == self.current_epoch:
            epochs[-1].update(values)

    def _finish_history(self) -> History:
        self._history.global_step, self._history.epoch = self.global_step, self.current_epoch
        return self._history


def floats(result: Mapping[str, Any]) -> dict[str, float]:
    """The one-element tensors and numbers of a result, as floats (a host sync)."""
    values = {}
    for key, value in result.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            values[key] = float(value.detach())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            values[key] = float(value)
    return values
