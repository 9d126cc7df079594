"""LRMonitor: recorded values, cadence, key names and logging through the trainer."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from dream_trainer.callbacks.lr_monitor import LRMonitor
from dream_trainer.configs import LoggingParameters
from dream_trainer.mixins import LoggerMixin
from tests.helpers.toy import (LoggedToyConfig, RecordingLogger, ToyTrainer, logged_toy_config,
                               toy_config)


class StepLRTrainer(ToyTrainer):
    """SGD at lr 0.1, halved every 3 optimizer steps."""

    def configure_schedulers(self) -> None:
        self.scheduler = StepLR(self.optimizer, step_size=3, gamma=0.5)


def reference_lrs(steps: int) -> list[float]:
    """``get_last_lr()`` of a plain StepLR after each of ``steps`` steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = StepLR(optimizer, step_size=3, gamma=0.5)
    values = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        values.append(scheduler.get_last_lr()[0])
    return values


def test_records_the_scheduled_learning_rate_after_every_step() -> None:
    monitor = LRMonitor()
    trainer = StepLRTrainer(toy_config(callbacks=[monitor], optimizer="sgd", lr=0.1,
                                       n_samples=80, n_epochs=2))
    trainer.fit()
    assert trainer.global_step == 20
    expected = reference_lrs(20)
    assert monitor.history == [(step, {"lr/optimizer": lr})
                               for step, lr in enumerate(expected, start=1)]
    assert monitor.latest == {"lr/optimizer": 0.1 * 0.5 ** 6}
    assert monitor.latest["lr/optimizer"] == trainer.scheduler.get_last_lr()[0]


def test_every_n_steps_counts_optimizer_steps_not_micro_batches() -> None:
    monitor = LRMonitor(every_n_steps=4)
    trainer = StepLRTrainer(toy_config(callbacks=[monitor], optimizer="sgd", lr=0.1,
                                       n_samples=160, gradient_accumulation_steps=2))
    trainer.fit()
    assert trainer.global_step == 10
    expected = reference_lrs(10)
    assert monitor.history == [(4, {"lr/optimizer": expected[3]}),
                               (8, {"lr/optimizer": expected[7]})]


class TwoOptimizers(ToyTrainer):
    """``optimizer`` has one group per linear layer; ``probe`` (never stepped) has one."""

    def configure_optimizers(self) -> None:
        first, last = self.model[0], self.model[3]
        self.optimizer = torch.optim.SGD([{"params": first.parameters(), "lr": 0.1},
                                          {"params": last.parameters(), "lr": 0.01}])
        self.probe = torch.optim.SGD(self.model.parameters(), lr=0.5)

    def configure_schedulers(self) -> None:
        self.scheduler = StepLR(self.optimizer, step_size=1, gamma=0.5)


class LoggingTrainer(TwoOptimizers, RecordingLogger):
    """With a logger mixin, whose log_dict records what the monitor logs."""


def test_every_group_of_every_optimizer_is_named_and_logged() -> None:
    monitor = LRMonitor(every_n_steps=2)
    trainer = LoggingTrainer(logged_toy_config(callbacks=[monitor], n_samples=32))
    trainer.fit()
    assert monitor.latest == pytest.approx(
        {"lr/optimizer/0": 0.1 / 16, "lr/optimizer/1": 0.01 / 16, "lr/probe": 0.5})
    assert [step for step, _ in monitor.history] == [2, 4]
    assert [(step, values) for values, step in trainer.logged] == monitor.history


def test_without_log_dict_values_are_only_kept() -> None:
    monitor = LRMonitor()
    trainer = TwoOptimizers(toy_config(callbacks=[monitor], n_samples=16))
    trainer.fit()
    assert not isinstance(trainer, LoggerMixin)
    assert len(monitor.history) == 2


def test_every_n_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be at least 1, got 0"):
        LRMonitor(every_n_steps=0)


def test_by_default_it_records_on_the_loggers_steps_and_every_step_without_one() -> None:
    # A record is a line in the log: by default on the steps the logger logs (every 3rd here),
    # not on every step.
    config = LoggedToyConfig(**dict(toy_config(callbacks=[LRMonitor()], n_samples=80)),
                             logging_parameters=LoggingParameters(enabled=False,
                                                                  log_every_n_steps=3))
    trainer = LoggingTrainer(config)
    trainer.fit()
    monitor = trainer.callbacks[0]
    assert trainer.global_step == 10
    assert [step for step, _ in monitor.history] == [3, 6, 9]
    assert [step for _, step in trainer.logged] == [3, 6, 9]
    # Without a logger there is no log to spare: every step.
    plain = LRMonitor()
    ToyTrainer(toy_config(callbacks=[plain], n_samples=40)).fit()
    assert [step for step, _ in plain.history] == [1, 2, 3, 4, 5]
