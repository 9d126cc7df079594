"""The toy trainer with torchmetrics metrics and loggers, for the EvalMixin/logger tests."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from dream_trainer.mixins import (EvalConfigMixin, EvalMixin, JSONLoggerConfigMixin,
                                  JSONLoggerMixin, WandBLoggerConfigMixin, WandBLoggerMixin)
from tests.helpers.checkpointing import CheckpointedConfig, CheckpointedTrainer


class MetricsConfig(CheckpointedConfig, EvalConfigMixin, JSONLoggerConfigMixin):
    pass


class MetricsTrainer(CheckpointedTrainer, EvalMixin, JSONLoggerMixin):
    """Regression metrics: a collection (MSE, MAE) and a single metric never updated."""

    def configure_metrics(self) -> None:
        from torchmetrics import MeanAbsoluteError, MeanSquaredError, MetricCollection

        self.errors = MetricCollection({"mse": MeanSquaredError(), "mae": MeanAbsoluteError()})
        self.unused = MeanSquaredError()

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        prediction = self.model(x)
        self.errors.update(prediction, y)
        return {"val_loss": F.mse_loss(prediction, y)}

    def post_fit(self) -> None:
        self.final_val = self.evaluate()
        super().post_fit()


class WandBConfig(MetricsConfig, WandBLoggerConfigMixin):
    pass


class WandBTrainer(MetricsTrainer, WandBLoggerMixin):
    """Logs to the local JSON file and to an offline wandb run at once."""
