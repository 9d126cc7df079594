"""An endless, stateful stream of regression samples that logs every sample it reads, and a
trainer reading it through torchdata's StatefulDataLoader with worker processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info

from dream_trainer import BaseTrainer, BaseTrainerConfig
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import (CheckpointConfigMixin, CheckpointMixin, SetupConfigMixin,
                                  SetupMixin)

FEATURES = 6


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sample ``index`` of the stream: features, target and the index itself."""
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(FEATURES, generator=generator)
    return x, x.sum(dim=0, keepdim=True) + 0.1 * torch.randn(1, generator=generator), index


class LoggedStream(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Samples ``r, r + R, r + 2R, ...`` of an endless stream for data-parallel rank ``r`` of
    ``R``, dealt round-robin to the loader's workers. Its state is, per worker, the next
    position to read; every sample read is appended to ``log`` (one JSON line per read)."""

    def __init__(self, rank: int, ranks: int, log: Path | None) -> None:
        self.rank, self.ranks, self.log = rank, ranks, log
        self.position = 0  # reads done by this worker (or by the only process)

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            index = (self.position * workers + worker) * self.ranks + self.rank
            self.position += 1
            if self.log is not None:
                with open(self.log, "a") as log:
                    log.write(json.dumps({"pid": os.getpid(), "index": index}) + "\n")
            yield sample(index)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class StreamConfig(BaseTrainerConfig, SetupConfigMixin, CheckpointConfigMixin):
    read_log: str | None = None
    workers: int = 2


def stream_config(root: Path, max_steps: int = 10, **checkpoint: Any) -> StreamConfig:
    return StreamConfig(
        project="stream", group="tests", experiment="run",
        device_parameters=DeviceParameters(),
        training_parameters=TrainingParameters(n_epochs=None, max_steps=max_steps,
                                               train_batch_size=4),
        checkpoint_parameters=CheckpointParameters(
            **{"root_dir": root, "every_n_steps": 4, "every_n_epochs": None,
               "resume": "latest", **checkpoint}))


class RecordsTrainedOn:
    """For a trainer (listed before its trainer bases): ``trained_on``, the stream positions
    this rank trained on, kept as per-rank checkpoint state so that a resumed run continues
    the record. ``training_step`` extends it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trained_on: list[int] = []

    def rank_state_dict(self) -> dict[str, Any]:
        return {**super().rank_state_dict(), "trained_on": self.trained_on}  # type: ignore[misc]

    def load_rank_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_rank_state_dict(state_dict)  # type: ignore[misc]
        self.trained_on = list(state_dict["trained_on"])


class StreamTrainer(RecordsTrainedOn, BaseTrainer, SetupMixin, CheckpointMixin):
    """A small regression with dropout on the logged stream; keeps the ids this rank trained
    on as per-rank state."""

    config: StreamConfig

    def configure_models(self) -> None:
        self.model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(0.1),
                                   nn.Linear(16, 1))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def configure_dataloaders(self) -> tuple[Any, None]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        log = self.config.read_log
        stream = LoggedStream(self.world.dp_rank, self.world.dp_size,
                              Path(log) if log else None)
        return StatefulDataLoader(stream, batch_size=self.config.training_parameters
                                  .train_batch_size, num_workers=self.config.workers), None

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, ids = batch
        self.trained_on.extend(ids.tolist())
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {}
