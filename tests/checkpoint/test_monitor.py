"""A misspelt ``monitor`` fails as soon as the keys are known (the first training step, the
first validation), not after an epoch with nothing saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config

# 10 optimizer steps per epoch; the first periodic save would be at step 4.
STEPS = "ckpt/tests/run/checkpoints"


class Unvalidated(CheckpointedTrainer):
    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return super().configure_dataloaders()[0], None


def trainer(root: Path, cls: type[CheckpointedTrainer] = CheckpointedTrainer,
            monitor: str = "val_los", **training: Any) -> CheckpointedTrainer:
    config = checkpointed_config(root, resume=None, keep_top_k=1, monitor=monitor)
    return cls(config.model_copy(update={"training_parameters": config.training_parameters
                                         .model_copy(update=training)}))


def fails_at_step(run: CheckpointedTrainer, keys: list[str]) -> int:
    with pytest.raises(ValueError) as error:
        run.fit()
    assert str(error.value) == (
        f"checkpoint_parameters.monitor='val_los' is not produced by any training or "
        f"validation step; available keys: {keys}. Set monitor to one of them (a named "
        "validation set's keys are '<name>/<key>'), or to None to keep the newest checkpoints")
    return run.global_step


def test_without_validation_it_fails_at_the_first_step(tmp_path: Path) -> None:
    run = trainer(tmp_path, Unvalidated)
    assert fails_at_step(run, ["grad_norm", "loss"]) == 1
    assert not (tmp_path / STEPS).exists() or not any((tmp_path / STEPS).glob("step_*"))


def test_after_a_sanity_check_it_fails_at_the_first_step(tmp_path: Path) -> None:
    run = trainer(tmp_path, num_sanity_val_steps=1)
    assert fails_at_step(run, ["grad_norm", "loss", "val_loss"]) == 1
    assert run.validated_at == []


def test_it_fails_at_the_first_validation(tmp_path: Path) -> None:
    run = trainer(tmp_path, val_every_n_steps=3)
    assert fails_at_step(run, ["grad_norm", "loss", "val_loss"]) == 3
    assert run.validated_at == []  # the trainer's own post_val_epoch never ran


@pytest.mark.parametrize("cls, monitor", [(CheckpointedTrainer, "val_loss"),
                                          (Unvalidated, "loss")])
def test_a_key_that_a_result_has_passes(tmp_path: Path, cls: type[CheckpointedTrainer],
                                        monitor: str) -> None:
    run = trainer(tmp_path, cls, monitor=monitor, num_sanity_val_steps=1, n_epochs=1)
    run.fit()
    assert run.global_step == 10
