"""A tiny script for the command-line tests: ``dream-trainer summarize <this file>:make_trainer``.

Its model, ``Linear(8, 16) -> Tanh -> Linear(16, 4)``, has 8*16 + 16 + 16*4 + 4 = 212
parameters. The ``__main__`` block trains as ``python cli_trainer.py [overrides]`` would; the
command line must never run it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import TrainingParameters, apply_cli_overrides

PARAMETERS = 212


class CliConfig(DreamTrainerConfig):
    learning_rate: float = 1e-2
    """AdamW learning rate."""
    hidden: int = 16
    """Width of the hidden layer."""
    samples: int = 64
    """Training samples (validation gets a quarter as many)."""
    warmup_steps: int = 0
    """Steps of a linear learning-rate warmup from 0 (a ``LambdaLR``); 0: no scheduler."""


class CliTrainer(DreamTrainer):
    config: CliConfig

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(8, self.config.hidden), nn.Tanh(),
                                   nn.Linear(self.config.hidden, 4))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate)

    def configure_schedulers(self) -> None:
        warmup = self.config.warmup_steps
        if warmup:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: min(1.0, step / warmup))

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        generator = torch.Generator().manual_seed(0)
        n = self.config.samples
        data = TensorDataset(torch.randn(n, 8, generator=generator),
                             torch.randn(n, 4, generator=generator))
        val = TensorDataset(torch.randn(n // 4, 8, generator=generator),
                            torch.randn(n // 4, 4, generator=generator))
        params = self.config.training_parameters
        return (DataLoader(data, batch_size=params.train_batch_size),
                DataLoader(val, batch_size=params.val_batch_size))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def make_trainer(args: Sequence[str] | None = None) -> CliTrainer:
    config = CliConfig(project="cli", group="tests", experiment="run", callbacks=[],
                       training_parameters=TrainingParameters(n_epochs=2, train_batch_size=8))
    return CliTrainer(apply_cli_overrides(config, args))


def make_trainer_without_args() -> CliTrainer:
    return make_trainer([])


def make_something_else() -> dict[str, int]:
    return {"not": 1}


NOT_CALLABLE = 3


if __name__ == "__main__":
    print("ran the script's __main__ block")
    make_trainer(sys.argv[1:]).fit()
