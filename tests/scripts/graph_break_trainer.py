"""A trainer whose blocks break torch.compile's graph at a known line, for the CLI test.

``dream-trainer find-graph-breaks <this file>:make_trainer`` must name ``BREAK_LINE`` (the
``torch._dynamo.graph_break()`` call) for both blocks of the ModuleList.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import TrainingParameters, apply_cli_overrides
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

BREAK_LINE = 31


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        x = self.linear(x) * scale
        torch._dynamo.graph_break()
        return torch.tanh(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x)


class Config(BaseTrainerConfig, SetupConfigMixin):
    pass


class BreakingTrainer(BaseTrainer, SetupMixin):
    def configure_models(self) -> None:
        self.model = Net()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        return DataLoader(data, batch_size=8), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def make_trainer(args: Sequence[str] | None = None) -> BreakingTrainer:
    config = Config(project="cli", group="tests", experiment="graph-breaks",
                    training_parameters=TrainingParameters(n_epochs=1, train_batch_size=8))
    return BreakingTrainer(apply_cli_overrides(config, args))
