"""A checkpointing toy trainer whose data carries sample ids, and tools to kill it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from dream_trainer.callbacks import Callback
from dream_trainer.configs import CheckpointParameters, DeviceParameters, TrainingParameters
from dream_trainer.mixins import CheckpointConfigMixin, CheckpointMixin
from tests.helpers.toy import ToyConfig, ToyTrainer, toy_dataset


class CheckpointedConfig(ToyConfig, CheckpointConfigMixin):
    rank_state: bool = True


class CheckpointedTrainer(ToyTrainer, CheckpointMixin):
    """Toy regression with dropout, a cosine schedule and sample ids in every batch.

    It also keeps state of its own that a resume must restore exactly: per rank, the ids of
    every sample this rank trained on (a list that grows and differs between ranks), and,
    shared, the steps at which validation ran (a list that grows).
    """

    config: CheckpointedConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ids_seen: list[int] = []
        self.validated_at: list[int] = []
        self.all_ids_seen: list[list[int]] = []

    def rank_state_dict(self) -> dict[str, Any]:
        mine = {"ids_seen": self.ids_seen} if self.config.rank_state else {}
        return {**super().rank_state_dict(), **mine}

    def load_rank_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_rank_state_dict(state_dict)
        if self.config.rank_state:
            self.ids_seen = list(state_dict["ids_seen"])

    def extra_state_dict(self) -> dict[str, Any]:
        return {**super().extra_state_dict(), "validated_at": self.validated_at}

    def load_extra_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_extra_state_dict(state_dict)
        self.validated_at = list(state_dict.get("validated_at", []))

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        super().post_val_epoch(result)
        if not (self.sanity_checking or self.evaluating):
            self.validated_at.append(self.global_step)

    def post_fit(self) -> None:
        super().post_fit()
        self.all_ids_seen = from_every_rank(self.world.world_size, self.ids_seen)

    def configure_schedulers(self) -> None:
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=40)

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        tp = self.config.training_parameters
        data = toy_dataset(self.config.n_samples, self.config, seed=1)
        ids = torch.arange(self.config.n_samples)
        train = DataLoader(TensorDataset(*data.tensors, ids), batch_size=tp.train_batch_size,
                           shuffle=True)
        val = DataLoader(toy_dataset(self.config.val_samples, self.config, seed=2),
                         batch_size=tp.val_batch_size)
        return train, val

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y, ids = batch
        self.seen_ids = ids.tolist()
        self.ids_seen.extend(self.seen_ids)
        return super().training_step((x, y), batch_idx)


def checkpointed_config(root: Path, device_parameters: DeviceParameters | None = None,
                        **checkpoint: Any) -> CheckpointedConfig:
    return CheckpointedConfig(
        project="ckpt", group="tests", experiment="run", dropout=0.2, shuffle=True,
        n_samples=80, val_samples=16,
        device_parameters=device_parameters or DeviceParameters(),
        training_parameters=TrainingParameters(n_epochs=3, train_batch_size=4,
                                               gradient_accumulation_steps=2),
        checkpoint_parameters=CheckpointParameters(
            **{"root_dir": root, "every_n_steps": 4, "resume": "latest", **checkpoint}),
    )


class Killer(Callback):
    """Signals this process at the given points, each only once per marker directory.

    Points: ``step:N`` (after optimizer step N, before any checkpoint at it), ``epoch_end:E``
    (after epoch E's end-of-epoch checkpoint), ``val:E`` (during epoch E's validation).
    """

    def __init__(self, points: list[str], markers: Path, rank_to_kill: int = 0,
                 sig: signal.Signals = signal.SIGKILL) -> None:
        self.points, self.markers, self.rank_to_kill = points, markers, rank_to_kill
        self.sig = sig

    def _maybe_kill(self, point: str) -> None:
        if point not in self.points or self.trainer.world.rank != self.rank_to_kill:
            return
        marker = self.markers / point.replace(":", "_")
        if marker.exists():
            return
        marker.touch()
        os.kill(os.getpid(), self.sig)

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            self._maybe_kill(f"step:{self.trainer.global_step}")

    def post_epoch(self) -> None:
        self._maybe_kill(f"epoch_end:{self.trainer.current_epoch}")

    def post_val_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self._maybe_kill(f"val:{self.trainer.current_epoch}")


class SampleLog(Callback):
    """Appends (rank, epoch, batch index, sample ids) of every micro-batch to a JSON-lines
    file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        record = {"rank": trainer.world.rank, "epoch": trainer.current_epoch,
                  "batch_idx": batch_idx, "ids": trainer.seen_ids}
        with open(self.path, "a") as log:
            log.write(json.dumps(record) + "\n")


def final_state(trainer: CheckpointedTrainer) -> dict[str, Any]:
    """Weights, optimizer and scheduler state to compare bit for bit."""
    model = getattr(trainer.model, "module", trainer.model)
    optimizer = trainer.optimizer.state_dict()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {index: {k: v.clone() for k, v in state.items()}
                      for index, state in optimizer["state"].items()},
        "lr": trainer.scheduler.get_last_lr(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "ids_seen_by_rank": trainer.all_ids_seen,
        "validated_at": trainer.validated_at,
    }


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["global_step"] == expected["global_step"]
    assert actual["lr"] == expected["lr"]
    assert actual["ids_seen_by_rank"] == expected["ids_seen_by_rank"]
    assert actual["validated_at"] == expected["validated_at"]
    for name, tensor in expected["weights"].items():
        assert torch.equal(actual["weights"][name], tensor), name
    for index, state in expected["optimizer"].items():
        for key, tensor in state.items():
            assert torch.equal(actual["optimizer"][index][key], tensor), (index, key)


def from_every_rank(world_size: int, value: Any) -> list[Any]:
    """``value`` as each rank has it, in rank order, on every rank (a collective)."""
    if world_size == 1:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def assert_same_weights(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Two snapshots (``{name: tensor or value}``) hold the same keys, tensors equal bit for
    bit and other values equal."""
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[name], value), name
        else:
            assert actual[name] == value, name
