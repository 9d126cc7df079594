"""torchrun script: ReduceLROnPlateau driven by a validation value that plateaus on a known
schedule; an uninterrupted run against one stopped after 3 epochs and resumed. Rank 0 saves
each run's learning rate after every epoch. Usage: plateau_run.py ROOT OUT"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.launch import save_on_rank_zero

# The value each epoch's validation reports: it improves, plateaus (a cut after 2 bad epochs,
# patience 1), improves, plateaus again.
VALUES = [1.0, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7]


class Plateau(CheckpointedTrainer):
    def configure_schedulers(self) -> None:
        self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            self.optimizer, mode="min", factor=0.5, patience=1)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        # Each rank reports the scripted value: the rank average is the value itself.
        return {**super().validation_step(batch, batch_idx),
                "val_metric": torch.tensor(VALUES[self.current_epoch])}

    def post_epoch(self) -> None:
        super().post_epoch()
        self.lrs = [*getattr(self, "lrs", []), self.optimizer.param_groups[0]["lr"]]


def run(root: Path, experiment: str, n_epochs: int) -> list[float]:
    base = checkpointed_config(root, every_n_steps=None)
    training = base.training_parameters.model_copy(update={"n_epochs": n_epochs})
    config = base.model_copy(update={"experiment": experiment, "optimizer": "sgd",
                                     "scheduler_monitor": "val_metric",
                                     "training_parameters": training})
    trainer = Plateau(config)
    trainer.fit()
    return trainer.lrs


def main(root: str, out: str) -> None:
    results = {"uninterrupted": run(Path(root), "whole", 7),
               "first": run(Path(root), "split", 3),
               "resumed": run(Path(root), "split", 7)}
    save_on_rank_zero(results, out, "plateau")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
