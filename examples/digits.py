"""Train an MLP on scikit-learn's bundled 8x8 digits (no download).

    python examples/digits.py
    torchrun --standalone --nproc_per_node=2 examples/digits.py
    python examples/digits.py --training_parameters.n_epochs 5 --learning_rate 1e-2

What it shows:

- The smallest complete trainer: ``BaseTrainer`` (the loop) plus ``SetupMixin`` (models on
  the meta device, optimizers, a scheduler, data loaders), a training step that calls
  ``backward`` and ``step``, and a validation step whose results the trainer averages over
  batches and ranks.
- The same script runs on one process or under torchrun: with two ranks the default
  ``DeviceParameters`` wrap the model in DDP and each rank reads half of every epoch.
- The config is built in code and any field can be overridden from the command line
  (``apply_cli_overrides``; ``--help`` lists them). ``make_trainer(args)`` is the entry point
  for tools such as the ``dream-trainer`` command line (``examples/digits.py:make_trainer``).

Rank 0 prints the last validation result as ``val_accuracy=<float>``. ``BaseTrainer`` has no
logger and no checkpoints, so the script writes no files; ``char_gpt.py`` shows
``DreamTrainer``, which does.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import TrainingParameters, apply_cli_overrides
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

N_FEATURES = 64  # 8x8 pixels
N_CLASSES = 10
N_VAL = 360  # divisible by 1 and 2 ranks, so every rank validates on an equal share


@functools.lru_cache(maxsize=1)
def digits_splits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """A fixed train/validation split, standardized with the training statistics only."""
    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = order[:N_VAL], order[N_VAL:]
    mean = features[train_idx].mean(dim=0)
    # Border pixels are always 0, so their std is 0: clamp to keep them at 0 instead of NaN.
    std = features[train_idx].std(dim=0).clamp_min(1e-6)
    features = (features - mean) / std
    return (TensorDataset(features[train_idx], labels[train_idx]),
            TensorDataset(features[val_idx], labels[val_idx]))


class DigitsConfig(BaseTrainerConfig, SetupConfigMixin):
    learning_rate: float = 3e-3
    """Peak AdamW learning rate (cosine-annealed to 0 over the run)."""
    hidden_size: int = 128
    """Width of the two hidden layers."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""


class DigitsTrainer(BaseTrainer, SetupMixin):
    config: DigitsConfig

    def __init__(self, config: DigitsConfig) -> None:
        super().__init__(config)
        self.latest_validation: dict[str, float] = {}

    def configure_models(self) -> None:
        # Runs under torch.device("meta"): shapes only, the weights come in init_weights.
        hidden = self.config.hidden_size
        self.model = nn.Sequential(
            nn.Linear(N_FEATURES, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, N_CLASSES),
        )

    def init_weights(self) -> None:
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate,
                                           weight_decay=self.config.weight_decay)

    def configure_schedulers(self) -> None:
        # step() steps this scheduler once per optimizer step, so T_max counts optimizer steps.
        total = self.config.training_parameters.n_epochs * self.optimizer_steps_per_epoch()
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=total)

    def optimizer_steps_per_epoch(self) -> int:
        """What each rank's DistributedSampler share (padded to equal size) gives per epoch."""
        params = self.config.training_parameters
        train, _ = digits_splits(self.config.seed or 0)
        per_rank = math.ceil(len(train) / self.world.dp_size)
        return math.ceil(per_rank / params.train_batch_size) // params.gradient_accumulation_steps

    def configure_dataloaders(self) -> tuple[DataLoader, DataLoader]:
        params = self.config.training_parameters
        train, val = digits_splits(self.config.seed or 0)
        # The trainer swaps these samplers for DistributedSamplers when there are 2+ ranks.
        return (DataLoader(train, batch_size=params.train_batch_size, shuffle=True),
                DataLoader(val, batch_size=params.val_batch_size))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        features, labels = batch
        loss = F.cross_entropy(self.model(features), labels)
        self.backward(loss)
        if not self.is_accumulating_gradients:
            grad_norm = self.step(self.model, self.optimizer)
            return {"loss": loss, "grad_norm": grad_norm}
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        features, labels = batch
        logits = self.model(features)
        return {"val_loss": F.cross_entropy(logits, labels),
                "val_accuracy": (logits.argmax(dim=1) == labels).float().mean()}

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        # Already averaged over batches and ranks, so every rank holds the same numbers.
        self.latest_validation = result


def default_config() -> DigitsConfig:
    """The run ``python examples/digits.py`` trains."""
    return DigitsConfig(
        project="examples",
        group="digits",
        experiment="mlp",
        training_parameters=TrainingParameters(n_epochs=20, train_batch_size=32,
                                               val_batch_size=N_VAL),
    )


def make_trainer(args: list[str] | None = None) -> DigitsTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides."""
    return DigitsTrainer(apply_cli_overrides(default_config(), args, description=__doc__))


def main() -> None:
    trainer = make_trainer()
    trainer.fit()
    if trainer.world.is_rank_zero:
        print(f"val_accuracy={trainer.latest_validation['val_accuracy']:.4f}")
        print("logs and checkpoints: none written (BaseTrainer has neither)")


if __name__ == "__main__":
    main()
