"""Script: rank 1's loader has fewer batches than rank 0's; both must finish, not hang."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.toy import ToyTrainer, toy_config


class Unequal(ToyTrainer):
    def configure_dataloaders(self) -> tuple[Any, None]:
        batches = 10 if self.world.rank == 0 else 6
        generator = torch.Generator().manual_seed(self.world.rank)
        return [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator))
                for _ in range(batches)], None


if __name__ == "__main__":
    trainer = Unequal(toy_config(n_epochs=2))
    trainer.fit()
    print(f"rank={trainer.world.rank} steps={trainer.global_step}")
