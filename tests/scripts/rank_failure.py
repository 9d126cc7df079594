"""Script: rank 1 raises in training_step at global step 2; rank 0 trains normally."""

from __future__ import annotations

from typing import Any

from tests.helpers.toy import ToyTrainer, toy_config


class FailsOnRankOne(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.world.rank == 1 and self.global_step == 2:
            raise RuntimeError("injected failure in training_step")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    FailsOnRankOne(toy_config(n_epochs=50, n_samples=160)).fit()
    print("finished without error")
