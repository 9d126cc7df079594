"""Script (2 ranks): MediaLogger under DDP, Histograms under FSDP2 and under tensor parallel.

Usage: ``observability_run.py OUT_DIR``. Each rank saves ``OUT_DIR/rank<r>.pt`` with what it
saw; the JSONL logs (rank 0's) go under ``OUT_DIR/<experiment>/``.

- ``media``: DDP; ``validation_step`` returns a batch of images under ``"samples"``;
  ``MediaLogger("samples", max_samples=6, nrow=3)`` with a sanity check of one batch. Saved:
  every ``log_images`` call this rank made (key, shape) and the samples it returned.
- ``fsdp`` / ``tp``: SGD, 3 optimizer steps, ``Histograms(every_n_steps=2)``. Saved: the full
  weights and gradients gathered (``full_tensor()``) at the steps Histograms logs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dream_trainer.callbacks import Callback, Histograms, MediaLogger
from dream_trainer.configs import DeviceParameters, LoggingParameters, TrainingParameters
from dream_trainer.mixins import JSONLoggerConfigMixin, JSONLoggerMixin
from tests.helpers.toy import ToyConfig, ToyTrainer


class Config(ToyConfig, JSONLoggerConfigMixin):
    pass


class Recording(ToyTrainer, JSONLoggerMixin):
    """Records every log_images call on this rank, whatever the backend then does."""

    media_calls: list[tuple[str, tuple[int, ...]]]
    returned: list[torch.Tensor]

    def log_images(self, key: str, images: Any, captions: Any = None) -> None:
        self.media_calls.append((key, tuple(images.shape)))
        super().log_images(key, images, captions)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        samples = torch.sigmoid(x).reshape(-1, 1, 2, 4)
        if not self.sanity_checking:
            self.returned.append(samples)
        return {"val_loss": F.mse_loss(self.model(x), y), "samples": samples}


class TensorParallel(Recording):
    def apply_tensor_parallel(self, tp_mesh: Any) -> None:
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        parallelize_module(self.model, tp_mesh, {"0": ColwiseParallel(), "3": RowwiseParallel()})


class Gather(Callback):
    """The full weights and gradients where Histograms looks (every rank gathers)."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def pre_optimizer_step(self, model: nn.Module, optimizer: Any) -> None:
        step = self.trainer.global_step
        if step % 2:
            return
        full: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            for kind, tensor in (("weights", param), ("gradients", param.grad)):
                gathered = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                full[f"{kind}/model/{name}"] = gathered.detach().clone()
        self.seen[step] = full


def config(root: Path, experiment: str, device: DeviceParameters, callbacks: list[Any],
           **training: Any) -> Config:
    return Config(project="obs", group="tests", experiment=experiment, optimizer="sgd",
                  n_samples=64, val_samples=32, device_parameters=device, callbacks=callbacks,
                  logging_parameters=LoggingParameters(log_dir=root, log_every_n_steps=100),
                  training_parameters=TrainingParameters(
                      **{"n_epochs": 1, "train_batch_size": 4, "val_batch_size": 4, **training}))


def run(trainer: Recording) -> Recording:
    trainer.media_calls, trainer.returned = [], []
    trainer.fit()
    return trainer


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    media = run(Recording(config(out, "media", DeviceParameters.DDP(),
                                 [MediaLogger("samples", 6, nrow=3)], num_sanity_val_steps=1)))
    result: dict[str, Any] = {"media_calls": media.media_calls, "returned": media.returned}
    for name, trainer_class, device in (
            ("fsdp", Recording, DeviceParameters.FSDP()),
            ("tp", TensorParallel, DeviceParameters(dp_replicate=1, tensor_parallel=2))):
        gather = Gather()
        run(trainer_class(config(out, name, device, [Histograms(every_n_steps=2), gather],
                                 max_steps=3)))
        result[name] = gather.seen
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
