"""A trainer measured at its setup, for the memory benchmarks of model creation and loading."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.processes import current_rss_bytes, peak_rss_bytes
from dream_trainer import BaseTrainer
from dream_trainer.mixins import SetupMixin


class SetupOnlyTrainer(BaseTrainer, SetupMixin):
    """A trainer whose models are all that counts: the rest is the least ``fit()`` needs (an
    optimizer that changes nothing, two placeholder samples, empty steps). Subclasses build
    the model in ``configure_models``; ``baseline`` is the RSS before configure and
    ``peak_above_baseline`` the peak RSS above it at the end of setup."""

    def pre_configure(self) -> None:
        self.baseline = current_rss_bytes()

    def post_setup(self) -> None:
        self.peak_above_baseline = peak_rss_bytes() - self.baseline

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return DataLoader(TensorDataset(torch.zeros(2, 1)), batch_size=1), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}
