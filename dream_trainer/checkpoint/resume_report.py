"""What a resumed run says about where it continues: the checkpoint, the step and the data
position, and whether its step budget is already spent."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dream_trainer.checkpoint.storage_base import Location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePosition:
    """Where a run resumed from a checkpoint stands, in this run's terms.

    Attributes:
        path: The checkpoint loaded.
        global_step: Optimizer steps done.
        epoch: The epoch the run continues in (0-indexed).
        batch: Micro-batches of that epoch already trained (0 at an epoch boundary).
        steps_per_epoch: Optimizer steps per epoch, as this run planned them (0 when a
            checkpoint is loaded before the setup phase planned them: nothing is then said
            about the budget).
        accumulation: Micro-batches per optimizer step.
        n_epochs: The configured epochs (None: ``max_steps`` alone ends the run).
        max_steps: The configured step budget, if any.
    """

    path: Location
    global_step: int
    epoch: int
    batch: int
    steps_per_epoch: int
    accumulation: int
    n_epochs: int | None
    max_steps: int | None

    @property
    def steps_left(self) -> int:
        """Optimizer steps the loop will still train: it stops when the epochs or
        ``max_steps`` run out, whichever comes first."""
        left = []
        if self.n_epochs is not None:
            epochs_left = max(0, self.n_epochs - self.epoch)
            left.append(epochs_left * self.steps_per_epoch
                        - min(epochs_left, 1) * self.batch // self.accumulation)
        if self.max_steps is not None:
            left.append(self.max_steps - self.global_step)
        return max(0, min(left)) if left else 0

    def log(self) -> None:
        """Log ``describe()`` at INFO, and ``spent()`` as a warning when nothing is left."""
        logger.info("%s", self.describe())
        spent = self.spent()
        if spent is not None:
            logger.warning("%s", spent)

    def describe(self) -> str:
        """``resumed from <path> at global step N: ...``: the data position and what is left."""
        head = f"resumed from {self.path} at global step {self.global_step}"
        if not self.steps_per_epoch:
            return f"{head}: epoch {self.epoch}, batch {self.batch}"
        batches = self.steps_per_epoch * self.accumulation
        if self.batch == 0:
            position = f"epoch {self.epoch} starts (batch 0 of {batches})"
        else:
            position = (f"epoch {self.epoch} continues at batch {self.batch} of {batches} "
                        f"({self.batch // self.accumulation} of its {self.steps_per_epoch} "
                        "optimizer steps done)")
        return f"{head}: {position}; {self.steps_left} optimizer steps left to train"

    def spent(self) -> str | None:
        """Why nothing is left to train, naming the budget and the fix; None when steps are
        left."""
        if not self.steps_per_epoch or self.steps_left > 0:
            return None
        budgets = []
        if self.n_epochs is not None:
            budgets.append(f"n_epochs={self.n_epochs} of {self.steps_per_epoch} steps")
        if self.max_steps is not None:
            budgets.append(f"max_steps={self.max_steps}")
        return (f"nothing left to train: the checkpoint {self.path} is at global step "
                f"{self.global_step} (epoch {self.epoch}), which already reaches this run's "
                f"budget ({' and '.join(budgets)}), so fit() trains no step. Raise "
                "max_steps/n_epochs to train further, or start a new experiment (another "
                "experiment name or root_dir; SetupConfigMixin.init_weights_from=<this "
                "checkpoint> starts it from these weights)")
