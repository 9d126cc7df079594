"""A tiny language model on variable-length, padded sequences, trained with a token-summed
loss (``backward(loss, num_items=...)``), and the one-process loop it must match."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

VOCAB, DIM, MAX_LEN, PAD = 11, 8, 12, -100


class PaddedSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sequences of 1 to MAX_LEN tokens; inputs padded with 0, targets with PAD (ignored)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=generator).tolist()
        self.tokens = torch.randint(0, VOCAB, (n, MAX_LEN + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.lengths[index]
        inputs = self.tokens[index, :-1].clone()
        targets = self.tokens[index, 1:].clone()
        inputs[length:] = 0
        targets[length:] = PAD
        return inputs, targets


def token_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh(),
                         nn.Linear(DIM, VOCAB))


def summed_loss(model: nn.Module, inputs: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the valid tokens, and their number."""
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=PAD,
                           reduction="sum")
    return loss, (targets != PAD).sum()


class TokenConfig(BaseTrainerConfig, SetupConfigMixin):
    lr: float = 0.5
    n_sequences: int = 48
    weighted: bool = True


def token_config(device_parameters: DeviceParameters, **training: Any) -> TokenConfig:
    """A TokenConfig; keywords naming its own fields set them, the rest go to training."""
    own = {k: training.pop(k) for k in list(training) if k in TokenConfig.model_fields}
    return TokenConfig(project="tokens", group="tests", experiment="weighted",
                       device_parameters=device_parameters,
                       training_parameters=TrainingParameters(**{"n_epochs": 1, **training}),
                       **own)


class TokenTrainer(BaseTrainer, SetupMixin):
    """Token-weighted (``weighted=True``) or per-micro-batch mean losses."""

    config: TokenConfig

    def configure_models(self) -> None:
        self.model = token_model()

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.config.lr)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        dataset = PaddedSequences(self.config.n_sequences)
        return DataLoader(dataset, batch_size=self.config.training_parameters.train_batch_size), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        loss, n = summed_loss(self.model, *batch)
        if self.config.weighted:
            self.backward(loss, num_items=n)
        else:
            self.backward(loss / n)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss / n}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}


def one_process_token_mean(config: TokenConfig, global_batch: int, steps: int) -> nn.Module:
    """Plain PyTorch: each step's loss is the mean over every valid token of its global batch."""
    assert config.seed is not None
    torch.manual_seed(config.seed)
    model = token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    loader = DataLoader(PaddedSequences(config.n_sequences), batch_size=global_batch)
    for step, (inputs, targets) in enumerate(loader):
        if step == steps:
            break
        loss, n = summed_loss(model, inputs, targets)
        (loss / n).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model
