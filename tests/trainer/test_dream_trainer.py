"""DreamTrainer: a subclass gets setup, metrics, checkpoints, logs and progress for free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dream_trainer import DreamTrainer, DreamTrainerConfig
from dream_trainer.configs import CheckpointParameters, LoggingParameters, TrainingParameters
from tests.helpers.toy import ToyConfig, toy_dataset, toy_model


class RegressionConfig(DreamTrainerConfig):
    lr: float = 1e-2


class Regression(DreamTrainer):
    config: RegressionConfig

    def configure_models(self) -> None:
        self.model = toy_model(ToyConfig(project="p", group="g", experiment="e",
                                         training_parameters={"n_epochs": 1,
                                                              "train_batch_size": 1}))

    def configure_optimizers(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.lr)

    def configure_metrics(self) -> None:
        from torchmetrics import MeanSquaredError

        self.mse = MeanSquaredError()

    def configure_dataloaders(self) -> tuple[DataLoader[Any], DataLoader[Any]]:
        shape = ToyConfig(project="p", group="g", experiment="e",
                          training_parameters={"n_epochs": 1, "train_batch_size": 1})
        return (DataLoader(toy_dataset(64, shape, seed=1), batch_size=8, shuffle=True),
                DataLoader(toy_dataset(16, shape, seed=2), batch_size=8))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)
        if not self.is_accumulating_gradients:
            self.step(self.model, self.optimizer)
        return {"loss": loss}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        prediction = self.model(x)
        self.mse.update(prediction, y)
        return {"val_loss": F.mse_loss(prediction, y)}


def make_config(root: Path) -> RegressionConfig:
    return RegressionConfig(
        project="dream", group="tests", experiment="e2e",
        training_parameters=TrainingParameters(n_epochs=2, train_batch_size=8),
        checkpoint_parameters=CheckpointParameters(root_dir=root),
        logging_parameters=LoggingParameters(log_dir=root, log_every_n_steps=4),
    )


def test_dream_trainer_runs_with_everything_on(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = make_config(tmp_path)
    assert [type(cb).__name__ for cb in config.callbacks] == ["ProgressBar", "LRMonitor"]
    trainer = Regression(config)
    trainer.fit()
    run = tmp_path / "dream/tests/e2e"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_16", "step_8"]
    rows = [json.loads(line) for line in (run / "logs/metrics.jsonl").read_text().splitlines()]
    validation = [row for row in rows if "mse/MeanSquaredError" in row]
    assert [row["step"] for row in validation] == [8, 16]
    assert validation[-1]["mse/MeanSquaredError"] == pytest.approx(validation[-1]["val_loss"],
                                                                   rel=1e-5)
    output = capsys.readouterr().out
    assert "\x1b" not in output and "step" in output  # plain progress lines off a terminal


def test_resume_latest_continues_where_the_run_stopped(tmp_path: Path) -> None:
    Regression(make_config(tmp_path)).fit()
    config = make_config(tmp_path)
    longer = config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update={"n_epochs": 3}),
        "checkpoint_parameters": config.checkpoint_parameters.model_copy(
            update={"resume": "latest"})})
    resumed = Regression(longer)
    resumed.fit()
    assert (resumed.global_step, resumed.current_epoch, resumed.local_batches) == (24, 3, 8)
