"""A small classifier with an exact torchmetrics metric and an odd-sized validation set, for
the tests that validation on N ranks equals one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import (CheckpointParameters, DeviceParameters, LoggingParameters,
                                   TrainingParameters)

FEATURES, HIDDEN, CLASSES = 8, 16, 5
TRAIN, VAL, HELD_OUT = 64, 361, 77  # odd sizes: they do not split evenly over 2 or 4 ranks


def classification_set(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, :CLASSES] + 0.5 * torch.randn(n, CLASSES, generator=generator))
                         .argmax(dim=1))


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class Classifier(nn.Module):
    """A residual block (the unit FSDP2 shards, tensor-parallel inside) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResidualMLP()])
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def classifier() -> nn.Module:
    return Classifier()


class ClassifierConfig(DreamTrainerConfig):
    lr: float = 0.1
    two_sets: bool = False
    """Validate on {"val": ..., "held_out": ...} instead of one loader."""


def classifier_config(root: Path, experiment: str, device_parameters: DeviceParameters,
                      **training: Any) -> ClassifierConfig:
    return ClassifierConfig(
        project="classifier", group="tests", experiment=experiment, callbacks=[],
        device_parameters=device_parameters,
        training_parameters=TrainingParameters(**{"n_epochs": 1, "train_batch_size": 8,
                                                  "val_batch_size": 20, **training}),
        checkpoint_parameters=CheckpointParameters(root_dir=root, every_n_epochs=None),
        logging_parameters=LoggingParameters(enabled=False))


class ClassifierTrainer(DreamTrainer):
    """Trains the classifier with SGD; validation reports a mean loss and an exact accuracy."""

    config: ClassifierConfig

    def configure_models(self) -> None:
        self.model = classifier()

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        for block in self.model.blocks:
            parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr)

    def configure_metrics(self) -> None:
        from torchmetrics.classification import MulticlassAccuracy

        self.accuracy = MulticlassAccuracy(num_classes=CLASSES, average="micro")

    def configure_dataloaders(self) -> tuple[DataLoader[Any], Any]:
        params = self.config.training_parameters
        train = DataLoader(classification_set(TRAIN, seed=1), batch_size=params.train_batch_size,
                           shuffle=True)
        val = DataLoader(classification_set(VAL, seed=2), batch_size=params.val_batch_size)
        if self.config.two_sets:
            return train, {"val": val, "held_out": held_out_loader(params.val_batch_size)}
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.backward(loss)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        logits = self.model(x)
        self.accuracy.update(logits, y)
        return {"val_loss": F.cross_entropy(logits, y)}


def held_out_loader(batch_size: int = 20) -> DataLoader[Any]:
    return DataLoader(classification_set(HELD_OUT, seed=3), batch_size=batch_size)


def one_process_results(weights: dict[str, torch.Tensor],
                        dataset: TensorDataset) -> dict[str, float]:
    """Accuracy and mean cross-entropy over the whole set, in plain PyTorch."""
    model = classifier()
    model.load_state_dict(weights)
    x, y = dataset.tensors
    with torch.no_grad():
        logits = model(x)
    return {"accuracy/MulticlassAccuracy": float((logits.argmax(dim=1) == y).float().mean()),
            "val_loss": float(F.cross_entropy(logits, y, reduction="sum")) / len(y)}
