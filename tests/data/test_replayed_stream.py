"""The data guide's row for an iterable loader with no position: a resume reads its epoch from
the start and discards the batches already done, which continues exactly when its order is
deterministic."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config
from tests.helpers.toy import toy_dataset


class Fixed(IterableDataset[tuple[torch.Tensor, ...]]):
    """The same samples in the same order every pass, with no state to save."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for index in range(len(self.data)):
            yield *self.data[index], torch.tensor(index)


class Replayed(CheckpointedTrainer):
    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        data = toy_dataset(self.config.n_samples, self.config, seed=1)
        return DataLoader(Fixed(data), batch_size=self.config.training_parameters
                          .train_batch_size), None


def config(root: Path, max_steps: int | None) -> Any:
    base = checkpointed_config(root, every_n_steps=None)
    return base.model_copy(update={"training_parameters": base.training_parameters.model_copy(
        update={"n_epochs": 1, "train_steps_per_epoch": 10, "max_steps": max_steps})})


def test_a_loader_without_a_position_is_replayed_to_the_same_weights(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    whole = Replayed(config(tmp_path / "whole", None))
    whole.fit()
    first = Replayed(config(tmp_path / "split", 6))
    first.fit()  # ends with a checkpoint at step 6, mid-epoch
    with caplog.at_level(logging.WARNING):
        resumed = Replayed(config(tmp_path / "split", None))
        resumed.fit()
    assert "reading and discarding 12 batches" in caplog.text  # 6 steps x 2 micro-batches
    assert resumed.global_step == whole.global_step == 10
    assert resumed.ids_seen == whole.ids_seen  # the checkpoint's, then the epoch's rest
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
