"""A GAN with two models and two optimizers, stepped on alternating batches.

    python examples/gan.py
    torchrun --standalone --nproc_per_node=2 examples/gan.py                       # DDP
    torchrun --standalone --nproc_per_node=2 examples/gan.py \
        --device_parameters.dp_replicate 1 --device_parameters.dp_shard auto      # FSDP2

What it shows:

- Several models and optimizers in one trainer: every ``nn.Module`` assigned in
  ``configure_models`` is a model, every optimizer assigned in ``configure_optimizers`` is
  stepped by an explicit ``self.step(model, optimizer)``. The generator learns to turn noise
  into samples of a 1-D Gaussian (mean 3, std 0.5); even batches train the discriminator, odd
  batches the generator.
- The parallelism is configuration, not code: the default ``DeviceParameters`` run one
  process under ``python`` and DDP under torchrun; the two overrides above shard both models
  with FSDP2 instead, and give exactly the same numbers.
- Any other field can be overridden too (``--training_parameters.n_epochs 4 --lr 1e-3``).

Rank 0 prints the mean of generated samples before and after training. ``BaseTrainer`` has no
logger and no checkpoints, so the script writes no files.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import TrainingParameters, apply_cli_overrides
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

TARGET_MEAN, TARGET_STD = 3.0, 0.5


class GANConfig(BaseTrainerConfig, SetupConfigMixin):
    noise_dim: int = 4
    """Size of the generator's input noise."""
    hidden: int = 32
    """Width of the hidden layer of both models."""
    lr: float = 2e-3
    """Adam learning rate of both optimizers."""
    n_samples: int = 4096
    """Real samples per epoch."""


class GANTrainer(BaseTrainer, SetupMixin):
    config: GANConfig

    def configure_models(self) -> None:
        hidden = self.config.hidden
        self.generator = nn.Sequential(nn.Linear(self.config.noise_dim, hidden), nn.ReLU(),
                                       nn.Linear(hidden, 1))
        self.discriminator = nn.Sequential(nn.Linear(1, hidden), nn.LeakyReLU(0.2),
                                           nn.Linear(hidden, 1))

    def configure_optimizers(self) -> None:
        betas = (0.5, 0.999)
        self.g_optimizer = torch.optim.Adam(self.generator.parameters(), lr=self.config.lr,
                                            betas=betas)
        self.d_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=self.config.lr,
                                            betas=betas)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        generator = torch.Generator().manual_seed(0)
        real = TARGET_MEAN + TARGET_STD * torch.randn(self.config.n_samples, 1,
                                                      generator=generator)
        loader = DataLoader(TensorDataset(real), shuffle=True,
                            batch_size=self.config.training_parameters.train_batch_size)
        return loader, None

    def noise(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.config.noise_dim, device=self.world.device)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (real,) = batch
        ones = torch.ones(len(real), 1, device=real.device)
        if batch_idx % 2 == 0:
            # The generator step left gradients on the discriminator: start clean.
            self.d_optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                fake = self.generator(self.noise(len(real)))
            loss = (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                    + F.binary_cross_entropy_with_logits(self.discriminator(fake), 0 * ones))
            self.backward(loss)
            return {"d_loss": loss, "d_grad_norm": self.step(self.discriminator,
                                                             self.d_optimizer)}
        fake = self.generator(self.noise(len(real)))
        loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.backward(loss)
        return {"g_loss": loss, "g_grad_norm": self.step(self.generator, self.g_optimizer)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}

    def sample_mean(self, n: int = 2048) -> float:
        """Mean of ``n`` generated samples (a collective under FSDP2: call on every rank)."""
        torch.manual_seed(1234)
        with torch.no_grad():
            return float(self.generator(self.noise(n)).mean())

    def post_setup(self) -> None:
        super().post_setup()
        self.mean_before = self.sample_mean()

    def post_fit(self) -> None:
        super().post_fit()
        self.mean_after = self.sample_mean()
        if self.world.is_rank_zero:
            print(f"generated mean: before={self.mean_before:.3f} "
                  f"after={self.mean_after:.3f} target={TARGET_MEAN}")


def default_config() -> GANConfig:
    """The run ``python examples/gan.py`` trains (DDP under torchrun)."""
    return GANConfig(project="examples", group="gan", experiment="gaussian",
                     training_parameters=TrainingParameters(n_epochs=16, train_batch_size=64))


def make_trainer(args: list[str] | None = None) -> GANTrainer:
    """The example's trainer, with ``args`` (default: the command line) as config overrides."""
    return GANTrainer(apply_cli_overrides(default_config(), args, description=__doc__))


def main() -> None:
    trainer = make_trainer()
    trainer.fit()  # post_fit prints the generated mean
    if trainer.world.is_rank_zero:
        print("logs and checkpoints: none written (BaseTrainer has neither)")


if __name__ == "__main__":
    main()
