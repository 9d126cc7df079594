"""A tiny regression through one MoE layer, and a trainer for it, for the MoE tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin
from dream_trainer.nn import MoE

DIM, HIDDEN, EXPERTS = 8, 12, 4


class MoEConfig(BaseTrainerConfig, SetupConfigMixin):
    weighted: bool = False
    """A summed loss with ``num_items`` instead of a mean loss."""
    experts: int = EXPERTS


class Tiny(nn.Module):
    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        self.embed = nn.Linear(4, DIM)
        # No auxiliary loss: it is computed per call (per micro-batch), so accumulated
        # micro-batches would not give one batch's update.
        self.moe = MoE(DIM, HIDDEN, experts, top_k=2, bias_update_rate=0.01)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x)))


class MoETrainer(BaseTrainer, SetupMixin):
    """SGD on 32 samples; records each step's expert load and bias before the step."""

    config: MoEConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        self.grad_norms: list[float] = []

    def configure_models(self) -> None:
        self.model = Tiny(self.config.experts)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        return DataLoader(data, batch_size=self.config.training_parameters.train_batch_size), None

    def moe(self) -> MoE:
        return getattr(self.model, "module", self.model).moe

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        if self.config.weighted:  # a sum over this micro-batch's items
            loss = F.mse_loss(self.model(x), y, reduction="sum")
            self.backward(loss, num_items=y.numel())
        else:
            loss = F.mse_loss(self.model(x), y) + self.moe().aux_loss
            self.backward(loss)
        if not self.is_accumulating_gradients:
            self.loads.append(self.moe().tokens_per_expert.clone())
            self.biases.append(self.moe().expert_bias.clone())
            self.grad_norms.append(float(self.step(self.model, self.optimizer)))
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def moe_config(batch: int, accumulation: int,
               device_parameters: DeviceParameters | None = None, **fields: Any) -> MoEConfig:
    return MoEConfig(
        project="moe", group="tests", experiment="run", **fields,
        device_parameters=device_parameters or DeviceParameters.SINGLE_DEVICE(),
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=batch,
                                               gradient_accumulation_steps=accumulation))
