"""A long run with every default callback leaks nothing and keeps only keep_top_k checkpoints."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import CheckpointParameters, LoggingParameters, TrainingParameters


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


class Tiny(DreamTrainer):
    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4000, 4, generator=generator),
                             torch.randn(4000, 1, generator=generator))
        return (DataLoader(data, batch_size=8, shuffle=True),
                DataLoader(TensorDataset(*data[:64]), batch_size=32))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        return {"loss": loss, "grad_norm": self.step(self.model, self.optimizer)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": F.mse_loss(self.model(x), y)}

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        super().post_train_batch(result, batch_idx)
        if self.global_step == 1000:  # after warm-up: allocator, dynamo import, first saves
            self.baseline = (rss_bytes(), len(os.listdir("/proc/self/fd")),
                             threading.active_count())


def test_5000_steps_leak_nothing_and_rotate_checkpoints(tmp_path: Path) -> None:
    config = DreamTrainerConfig(
        project="long", group="tests", experiment="run",
        training_parameters=TrainingParameters(n_epochs=10, train_batch_size=8, val_batch_size=32),
        checkpoint_parameters=CheckpointParameters(root_dir=tmp_path, every_n_steps=250,
                                                   keep_top_k=3),
        logging_parameters=LoggingParameters(log_dir=tmp_path, log_every_n_steps=50),
    )
    trainer = Tiny(config)
    trainer.fit()
    assert trainer.global_step == 5000
    rss, fds, threads = trainer.baseline
    assert rss_bytes() < rss * 1.05, (rss_bytes(), rss)
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert threading.active_count() <= threads
    checkpoints = sorted(p.name for p in (tmp_path / "long/tests/run/checkpoints").iterdir())
    assert checkpoints == ["step_4500", "step_4750", "step_5000"]
