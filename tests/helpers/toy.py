"""A tiny regression trainer and the hand-written PyTorch loop it must match."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import LoggingParameters, TrainingParameters
from dream_trainer.mixins import JSONLoggerConfigMixin, LoggerMixin, SetupConfigMixin, SetupMixin


class ToyConfig(BaseTrainerConfig, SetupConfigMixin):
    lr: float = 1e-2
    optimizer: Literal["sgd", "adamw"] = "adamw"
    n_samples: int = 160
    val_samples: int = 32
    in_features: int = 8
    hidden: int = 16
    out_features: int = 4
    shuffle: bool = False
    dropout: float = 0.0


def toy_config(**training: Any) -> ToyConfig:
    extra = {k: training.pop(k) for k in list(training) if k in ToyConfig.model_fields}
    return ToyConfig(project="toy", group="tests", experiment="run",
                     training_parameters=TrainingParameters(
                         **{"n_epochs": 1, "train_batch_size": 8, **training}),
                     **extra)


class LoggedToyConfig(ToyConfig, JSONLoggerConfigMixin):
    pass


def logged_toy_config(**training: Any) -> LoggedToyConfig:
    """``toy_config`` for a trainer with a logger mixin that writes no files: its own
    ``log_dict`` records what callbacks log."""
    return LoggedToyConfig(**dict(toy_config(**training)),
                           logging_parameters=LoggingParameters(enabled=False))


class RecordingLogger(LoggerMixin):
    """A logger backend that keeps what ``log_dict`` receives in ``logged``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logged: list[tuple[dict[str, float], int | None]] = []

    def log_dict(self, values: Any, step: int | None = None) -> None:
        super().log_dict(values, step)
        self.logged.append((dict(values), step))


def toy_dataset(n: int, config: ToyConfig, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, config.in_features, generator=generator)
    y = torch.randn(n, config.out_features, generator=generator)
    return TensorDataset(x, y)


def toy_model(config: ToyConfig) -> nn.Module:
    return nn.Sequential(nn.Linear(config.in_features, config.hidden), nn.Tanh(),
                         nn.Dropout(config.dropout),
                         nn.Linear(config.hidden, config.out_features))


def toy_optimizer(config: ToyConfig, params: Any) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    return torch.optim.AdamW(params, lr=config.lr)


class ToyTrainer(BaseTrainer, SetupMixin):
    config: ToyConfig

    def configure_models(self) -> None:
        self.model = toy_model(self.config)

    def configure_optimizers(self) -> None:
        self.optimizer = toy_optimizer(self.config, self.model.parameters())

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        tp = self.config.training_parameters
        train = DataLoader(toy_dataset(self.config.n_samples, self.config, seed=1),
                           batch_size=tp.train_batch_size, shuffle=self.config.shuffle)
        val = DataLoader(toy_dataset(self.config.val_samples, self.config, seed=2),
                         batch_size=tp.val_batch_size)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        if not self.is_accumulating_gradients:
            return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}


def hand_written_loop(config: ToyConfig, steps: int, ddp: bool = False) -> nn.Module:
    """Plain PyTorch: seed, build, (DDP-wrap,) and train ``steps`` optimizer steps."""
    assert config.seed is not None
    torch.manual_seed(config.seed)
    model = toy_model(config)
    dataset = toy_dataset(config.n_samples, config, seed=1)
    sampler = None
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(dataset, shuffle=False)
        model = DistributedDataParallel(model)
    optimizer = toy_optimizer(config, model.parameters())
    loader = DataLoader(dataset, batch_size=config.training_parameters.train_batch_size,
                        sampler=sampler)
    model.train()
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.module if ddp else model  # type: ignore[return-value]
