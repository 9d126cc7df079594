"""A GAN with two models and two optimizers, stepped on alternating batches.

The generator learns to turn noise into samples of a 1-D Gaussian (mean 3, std 0.5). Even
batches train the discriminator, odd batches the generator. The same trainer runs in one
process, with DDP or with FSDP2, chosen on the command line:

    python examples/gan.py
    torchrun --standalone --nproc_per_node=2 examples/gan.py --parallel ddp
    torchrun --standalone --nproc_per_node=2 examples/gan.py --parallel fsdp
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import DeviceParameters, TrainingParameters
from dream_trainer.mixins import SetupConfigMixin, SetupMixin

TARGET_MEAN, TARGET_STD = 3.0, 0.5


class GANConfig(BaseTrainerConfig, SetupConfigMixin):
    noise_dim: int = 4
    hidden: int = 32
    lr: float = 2e-3
    n_samples: int = 4096


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


PARALLEL = {"single": DeviceParameters.SINGLE_DEVICE, "ddp": DeviceParameters.DDP,
            "fsdp": DeviceParameters.FSDP}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", choices=sorted(PARALLEL), default="single")
    parser.add_argument("--epochs", type=int, default=16)
    args = parser.parse_args()
    config = GANConfig(
        project="examples", group="gan", experiment=args.parallel,
        device_parameters=PARALLEL[args.parallel](),
        training_parameters=TrainingParameters(n_epochs=args.epochs, train_batch_size=64),
    )
    GANTrainer(config).fit()


if __name__ == "__main__":
    main()
