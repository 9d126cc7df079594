"""Script: train the tiny transformer with an EMA callback, single-process or FSDP2, validating
every 2 steps, and save the full EMA and trained weights (gathered from every shard).

Usage: ema_run.py OUT CHECKPOINT_ROOT single|fsdp
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks.ema import EMA
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.launch import save_on_rank_zero
from tests.helpers.transformer import SEQ, VOCAB, TransformerConfig, TransformerTrainer

GLOBAL_BATCH = 8
DECAY = 0.8
MODES = {"single": (DeviceParameters.SINGLE_DEVICE(), 1), "fsdp": (DeviceParameters.FSDP(), 2)}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class EMAConfig(TransformerConfig, CheckpointConfigMixin):
    pass


class EMATransformer(TransformerTrainer, CheckpointMixin):
    """The tiny transformer with validation data; records what the test compares.

    Gathering DTensors is a collective, so it happens in post_fit, while the group exists.
    """

    config: EMAConfig

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        train, _ = super().configure_dataloaders()
        tokens = torch.randint(0, VOCAB, (16, SEQ + 1), generator=torch.Generator().manual_seed(4))
        batch = self.config.training_parameters.val_batch_size
        return train, DataLoader(TensorDataset(tokens), batch_size=batch)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return {"val_loss": F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))}

    def post_setup(self) -> None:
        super().post_setup()
        self.val_losses: list[float] = []

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        self.val_losses.append(result["val_loss"])

    def post_fit(self) -> None:
        super().post_fit()
        ema = self.callbacks[0]
        state = ema.state_dict()
        self.ema = {k: full(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.ema_types = {k: type(v).__name__ for k, v in state.items()}
        self.final = {k: full(v) for k, v in self.model.named_parameters()}


def run(mode: str, root: Path) -> dict[str, Any]:
    params, dp = MODES[mode]
    config = EMAConfig(
        project="ema", group="tests", experiment=mode, device_parameters=params,
        callbacks=[EMA(decay=DECAY)],
        training_parameters=TrainingParameters(n_epochs=1, train_batch_size=GLOBAL_BATCH // dp,
                                               val_batch_size=8 // dp, max_steps=6,
                                               val_every_n_steps=2, num_sanity_val_steps=1),
        checkpoint_parameters=CheckpointParameters(root_dir=root, every_n_epochs=None))
    trainer = EMATransformer(config)
    trainer.fit()
    return {"ema": trainer.ema, "ema_types": trainer.ema_types, "final": trainer.final,
            "val_losses": trainer.val_losses, "global_step": trainer.global_step,
            "checkpoint": str(trainer.checkpoint_dir / f"step_{trainer.global_step}")}


def main(out: str, root: str, mode: str) -> None:
    save_on_rank_zero(run(mode, Path(root)), out, "ema_run")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
