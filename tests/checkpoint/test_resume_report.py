"""A resumed run says which checkpoint, step and data position it continues from, and warns
when its step budget is already spent."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from dream_trainer.checkpoint.resume_report import ResumePosition
from tests.helpers.checkpointing import CheckpointedTrainer, checkpointed_config

STEPS = "ckpt/tests/run/checkpoints"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 3 epochs of 10 optimizer steps (20 micro-batches, accumulation 2):
    checkpoints every 4 steps, at each epoch's end and at step 30."""
    root = tmp_path_factory.mktemp("finished")
    CheckpointedTrainer(checkpointed_config(root, resume=None)).fit()
    return root


def resume(root: Path, resume: str | Path, **training: Any) -> CheckpointedTrainer:
    config = checkpointed_config(root, resume=resume)
    trainer = CheckpointedTrainer(config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update=training)}))
    trainer.fit()
    return trainer


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.levelno == level and record.name.startswith("dream_trainer")]


@pytest.mark.parametrize(("step", "position", "left"), [
    (8, "epoch 0 continues at batch 16 of 20 (8 of its 10 optimizer steps done)", 22),
    (10, "epoch 1 starts (batch 0 of 20)", 20),
    (24, "epoch 2 continues at batch 8 of 20 (4 of its 10 optimizer steps done)", 6),
])
def test_a_resume_names_the_checkpoint_the_step_and_the_data_position(
        finished: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, step: int,
        position: str, left: int) -> None:
    caplog.set_level(logging.INFO, logger="dream_trainer")
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    checkpoint = tmp_path / STEPS / f"step_{step}"
    trainer = resume(tmp_path, checkpoint)
    assert (f"resumed from {checkpoint} at global step {step}: {position}; {left} optimizer "
            "steps left to train") in messages(caplog, logging.INFO)
    assert trainer.global_step == 30  # it did train the steps it said were left
    assert not [m for m in messages(caplog, logging.WARNING) if "nothing left" in m]


def test_a_resume_whose_budget_is_spent_warns_that_nothing_is_left(
        finished: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dream_trainer")
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / STEPS / "step_30"
    trainer = resume(tmp_path, "latest")
    assert trainer.global_step == 30
    assert (f"resumed from {newest} at global step 30: epoch 3 starts (batch 0 of 20); 0 "
            "optimizer steps left to train") in messages(caplog, logging.INFO)
    # (Besides it, a warning lists the config's changes: resume and root_dir here.)
    assert [m for m in messages(caplog, logging.WARNING) if m.startswith("nothing left")] == [
        f"nothing left to train: the checkpoint {newest} is at global step 30 (epoch 3), "
        "which already reaches this run's budget (n_epochs=3 of 10 steps), so fit() trains "
        "no step. Raise max_steps/n_epochs to train further, or start a new experiment "
        "(another experiment name or root_dir; SetupConfigMixin.init_weights_from=<this "
        "checkpoint> starts it from these weights)"]

    # A step budget below the checkpoint's step is spent too; a raised one is not.
    caplog.clear()
    resume(tmp_path, tmp_path / STEPS / "step_24", max_steps=24)
    assert [m for m in messages(caplog, logging.WARNING) if m.startswith("nothing left")] == [
        f"nothing left to train: the checkpoint {tmp_path / STEPS / 'step_24'} is at global "
        "step 24 (epoch 2), which already reaches this run's budget (n_epochs=3 of 10 steps "
        "and max_steps=24), so fit() trains no step. Raise max_steps/n_epochs to train "
        "further, or start a new experiment (another experiment name or root_dir; "
        "SetupConfigMixin.init_weights_from=<this checkpoint> starts it from these weights)"]
    caplog.clear()
    trainer = resume(tmp_path, "latest", n_epochs=4)
    assert trainer.global_step == 40
    assert (f"resumed from {newest} at global step 30: epoch 3 starts (batch 0 of 20); 10 "
            "optimizer steps left to train") in messages(caplog, logging.INFO)
    assert not [m for m in messages(caplog, logging.WARNING) if "nothing left" in m]


@pytest.mark.parametrize(("fields", "left"), [
    ({"n_epochs": 3, "max_steps": None}, 15),   # 2 epochs and the 5 steps left of this one
    ({"n_epochs": 3, "max_steps": 20}, 8),      # max_steps comes first
    ({"n_epochs": None, "max_steps": 12}, 0),   # only max_steps, spent
    ({"n_epochs": 1, "max_steps": None}, 0),    # the epochs ran out
])
def test_steps_left_stop_at_whichever_budget_comes_first(fields: dict[str, Any],
                                                         left: int) -> None:
    # Epoch 1 (0-indexed) with 5 of its 10 steps done (10 micro-batches of accumulation 2),
    # at global step 12: the epochs count from the position, max_steps from the step.
    position = ResumePosition(Path("step_12"), global_step=12, epoch=1, batch=10,
                              steps_per_epoch=10, accumulation=2, **fields)
    assert position.steps_left == left
    assert (position.spent() is None) == (left > 0)
