"""What fit() returns (the run's history), the on_log hook, and schedulers stepped per epoch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dream_trainer import StopTraining
from dream_trainer.callbacks import Callback
from dream_trainer.trainer.history import History
from tests.helpers.metrics import MetricsTrainer
from tests.helpers.toy import ToyTrainer, toy_config
from tests.mixins.test_logging import config as logged_config


class Seen(Callback):
    """What the hooks saw: epoch results, validation results, logged dicts."""

    def __init__(self) -> None:
        self.train_epochs: list[dict[str, Any]] = []
        self.validations: list[dict[str, Any]] = []
        self.logged: list[tuple[dict[str, float], int]] = []

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self.train_epochs.append({key: float(value) for key, value in result.items()})

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if not (self.trainer.sanity_checking or self.trainer.evaluating):
            self.validations.append({key: float(value) for key, value in result.items()})

    def on_log(self, values: Any, step: int) -> None:
        self.logged.append((dict(values), step))


def test_fit_returns_the_epochs_validations_and_final_step() -> None:
    seen = Seen()
    config = toy_config(n_epochs=3, num_sanity_val_steps=1, callbacks=[seen])
    trainer = ToyTrainer(config)
    history = trainer.fit()
    assert isinstance(history, History)
    assert history.global_step == trainer.global_step == 60  # 160 samples / 8, 3 epochs
    assert history.epoch == 3
    assert history.steps == []  # no logger: no step is logged
    assert [row["epoch"] for row in history.epochs] == [0, 1, 2]
    assert [row["step"] for row in history.epochs] == [20, 40, 60]
    # The epoch rows are the hooks' results under the logger's keys, validation merged in.
    for row, train, validation in zip(history.epochs, seen.train_epochs, seen.validations):
        assert row == {"epoch": row["epoch"], "step": row["step"],
                       **{f"train_epoch/{key}": value for key, value in train.items()},
                       **validation}
    assert history.per_epoch("train_epoch/loss") == [train["loss"] for train in seen.train_epochs]
    assert history.per_epoch("val_loss") == [v["val_loss"] for v in seen.validations]
    # The sanity check is not part of the history: three passes, one per epoch.
    assert [row["step"] for row in history.validations] == [20, 40, 60]
    assert history.per_epoch("train_epoch/loss")[-1] < history.per_epoch("train_epoch/loss")[0]


def test_a_run_stopped_early_returns_its_history() -> None:
    class StopAtFive(Callback):
        def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
            if self.trainer.global_step == 5:
                raise StopTraining("enough")

    history = ToyTrainer(toy_config(n_epochs=2, callbacks=[StopAtFive()])).fit()
    assert history.global_step == 5 and history.epoch == 0
    assert history.epochs == []


def test_logged_steps_and_on_log_see_exactly_what_the_logger_wrote(tmp_path: Path) -> None:
    """Every dict the JSON logger wrote reached on_log (rank 0), with its step, in order; the
    history's steps are the logged training steps."""
    seen = Seen()
    trainer = MetricsTrainer(logged_config(tmp_path).model_copy(update={"callbacks": [seen]}))
    history = trainer.fit()
    lines = (tmp_path / "ckpt/tests/run/logs/metrics.jsonl").read_text().splitlines()
    written = [json.loads(line) for line in lines]
    assert len(written) > 4
    assert [{"step": step, **values} for values, step in seen.logged] == written
    step_rows = [row for row in written if "trainer/global_step" in row]
    assert [row["step"] for row in history.steps] == [4, 8]
    for mine, row in zip(history.steps, step_rows):
        assert {key: mine[key] for key in ("loss", "grad_norm")} == \
            {key: row[key] for key in ("loss", "grad_norm")}
    assert history.per_step("loss") == [row["loss"] for row in step_rows]


class StepLR(ToyTrainer):
    def configure_schedulers(self) -> None:
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)


class LearningRates(Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.rates.append(self.trainer.optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_scheduler_steps_per_step_or_per_epoch(interval: str) -> None:
    rates = LearningRates()
    config = toy_config(n_epochs=3, train_steps_per_epoch=4, scheduler_interval=interval,
                        callbacks=[rates], lr=1.0)
    trainer = StepLR(config)
    trainer.fit()
    if interval == "step":  # halved after every optimizer step
        assert rates.rates == [0.5 ** step for step in range(1, 13)]
    else:  # halved after each epoch's last step: 1.0 for epoch 0, 0.5 for epoch 1, ...
        assert rates.rates == [1.0] * 4 + [0.5] * 4 + [0.25] * 4
    assert trainer.scheduler.last_epoch == (12 if interval == "step" else 3)
