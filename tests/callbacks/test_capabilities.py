"""Callbacks declare the trainer capabilities they need: refused at attach without them,
optional ones decided once at attach."""

from __future__ import annotations

import io
from typing import Any

import pytest

from dream_trainer.callbacks import (Callback, CallbackCollection, Histograms, LRMonitor,
                                     ModelSummary, Profiler, ProgressBar, RankZeroCallback,
                                     Throughput, TrainerHooks, TrainerSummary)
from dream_trainer.configs import DeviceParameters
from dream_trainer.trainer.abstract import AbstractTrainer
from dream_trainer.trainer.base import BaseTrainer
from dream_trainer.world import DistributedWorld, LaunchEnvironment
from tests.helpers.toy import RecordingLogger, ToyTrainer, logged_toy_config, toy_config


class LoopOnly(TrainerHooks):
    """A trainer that is not a ``BaseTrainer``: it has a world, and nothing else."""

    def __init__(self, rank: int = 0) -> None:
        self.world = DistributedWorld(
            DeviceParameters(), LaunchEnvironment(rank=rank, world_size=2, launched=True))


class LoggingToy(ToyTrainer, RecordingLogger):
    """A toy trainer whose logger records what ``log_dict`` receives."""


# What each reads of the trainer: the loop's counters and batch sizes (BaseTrainer), or only
# the models and the world every trainer has (AbstractTrainer).
DECLARED = [(ProgressBar, BaseTrainer), (TrainerSummary, BaseTrainer),
            (Throughput, BaseTrainer), (ModelSummary, AbstractTrainer),
            (Profiler, AbstractTrainer)]


@pytest.mark.parametrize(("make", "needs"), DECLARED, ids=lambda x: x.__name__)
def test_a_callback_is_refused_by_a_trainer_without_what_it_declares(make: Any,
                                                                     needs: type) -> None:
    assert make.trainer_requirements() == (needs,)
    with pytest.raises(TypeError) as refused:
        CallbackCollection([make()]).attach(LoopOnly())
    assert str(refused.value) == (
        f"{make.__name__} requires a trainer that is a {needs.__name__}, but LoopOnly is not: "
        f"add {needs.__name__} (from {needs.__module__}) to the bases of LoopOnly, or "
        "remove the callback")


def test_the_same_callbacks_attach_to_a_base_trainer_and_run() -> None:
    callbacks = [ProgressBar(stream=io.StringIO()), ModelSummary(stream=io.StringIO()),
                 TrainerSummary(stream=io.StringIO()), Throughput(window=2)]
    trainer = ToyTrainer(toy_config(callbacks=callbacks, n_samples=32))
    trainer.fit()
    assert all(callback.trainer is trainer for callback in callbacks)
    assert len(callbacks[3].step_times) == 2  # the 2 optimizer steps of the window


def test_a_required_mixin_is_named_with_its_module() -> None:
    with pytest.raises(TypeError, match=r"^Histograms requires a trainer that is a LoggerMixin, "
                                        r"but ToyTrainer is not: add LoggerMixin \(from "
                                        r"dream_trainer\.mixins\.logging\) to the bases of "
                                        r"ToyTrainer, or remove the callback$"):
        ToyTrainer(toy_config(callbacks=[Histograms()]))
    trainer = LoggingToy(logged_toy_config(callbacks=[Histograms()]))
    assert trainer.callbacks[0].trainer is trainer


def test_attached_runs_once_per_attach_after_the_requirements_and_with_the_trainer() -> None:
    class Needs:
        """Stands in for a mixin."""

    class Able(LoopOnly, Needs):
        pass

    seen: list[Any] = []

    class Deciding(RankZeroCallback[Needs]):
        def attached(self) -> None:
            seen.append(self.trainer)

    callback = Deciding()
    collection = CallbackCollection([callback])
    with pytest.raises(TypeError, match="requires a trainer that is a Needs"):
        collection.attach(LoopOnly())
    assert seen == []
    first, second = Able(), Able(rank=1)
    collection.attach(first)
    assert seen == [first]
    # Bound, and decided, on every rank: a rank-zero callback's hooks run on rank 0 only.
    collection.attach(second)
    assert seen == [first, second] and callback.trainer is second
    assert collection.listeners("pre_fit") == []


def test_lr_monitor_logs_through_a_logger_and_keeps_its_history_without_one() -> None:
    logged = LRMonitor(every_n_steps=2)
    trainer = LoggingToy(logged_toy_config(callbacks=[logged], optimizer="sgd", lr=0.1,
                                           n_samples=32))
    trainer.fit()
    lr_entries = [(values, step) for values, step in trainer.logged if "lr/optimizer" in values]
    assert lr_entries == [({"lr/optimizer": 0.1}, 2), ({"lr/optimizer": 0.1}, 4)]

    quiet = LRMonitor(every_n_steps=2)
    plain = ToyTrainer(toy_config(callbacks=[quiet], optimizer="sgd", lr=0.1, n_samples=32))
    plain.fit()
    assert quiet.history == [(2, {"lr/optimizer": 0.1}), (4, {"lr/optimizer": 0.1})]
    assert not hasattr(plain, "log_dict")


def test_throughput_logs_on_rank_zero_through_a_logger_only() -> None:
    logged = Throughput(window=2)
    trainer = LoggingToy(logged_toy_config(callbacks=[logged], n_samples=32))
    trainer.fit()
    steps = [step for values, step in trainer.logged if "throughput/step_time" in values]
    assert steps == [2, 4]

    quiet = Throughput(window=2)
    ToyTrainer(toy_config(callbacks=[quiet], n_samples=32)).fit()
    assert set(quiet.latest) == {"throughput/step_time", "throughput/samples_per_second"}


def test_a_callback_without_declared_capabilities_attaches_anywhere() -> None:
    class Plain(Callback):
        pass

    assert Plain.trainer_requirements() == ()
    collection = CallbackCollection([Plain()])
    collection.attach(LoopOnly())
    assert collection[0].trainer is not None
