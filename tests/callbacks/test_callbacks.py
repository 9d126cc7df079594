"""Callback dispatch, requirements, typo detection and state."""

from __future__ import annotations

from typing import Any

import pytest

from dream_trainer.callbacks import (HOOK_NAMES, Callback, CallbackCollection,
                                     RankZeroCallback, TrainerHooks)
from dream_trainer.configs import DeviceParameters
from dream_trainer.world import DistributedWorld, LaunchEnvironment

CONTRACT_HOOKS = (
    "pre_launch", "pre_configure", "post_configure", "pre_setup", "post_setup", "pre_fit",
    "pre_epoch", "pre_train_epoch", "pre_train_batch", "post_train_batch",
    "pre_optimizer_step", "post_optimizer_step", "post_train_epoch", "pre_val_epoch",
    "pre_val_batch", "post_val_batch", "post_val_epoch", "post_epoch", "post_fit",
    "on_exception", "on_log",
)


class Capability:
    """Stands in for a mixin a callback can require."""


class FakeTrainer(TrainerHooks):
    def __init__(self, rank: int = 0) -> None:
        self.world = DistributedWorld(
            DeviceParameters(), LaunchEnvironment(rank=rank, world_size=2, launched=True))


class CapableTrainer(FakeTrainer, Capability):
    pass


def test_hook_set_is_exactly_the_contract() -> None:
    assert HOOK_NAMES == CONTRACT_HOOKS


class Log(Callback):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def pre_fit(self) -> None:
        self.log.append(f"{self.name}.pre_fit")

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.log.append(f"{self.name}.post_train_batch({batch_idx})")


class OnlyEpochs(Callback):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def pre_epoch(self) -> None:
        self.log.append("epochs.pre_epoch")


def test_dispatch_in_insertion_order_and_only_to_overriders() -> None:
    log: list[str] = []
    first, second, epochs = Log("a", log), Log("b", log), OnlyEpochs(log)
    collection = CallbackCollection([first, epochs, second])
    collection.attach(FakeTrainer())
    collection.pre_fit()
    collection.post_train_batch({}, 3)
    collection.pre_epoch()
    collection.post_fit()
    assert log == ["a.pre_fit", "b.pre_fit", "a.post_train_batch(3)", "b.post_train_batch(3)",
                   "epochs.pre_epoch"]
    assert collection.listeners("pre_fit") == [first.pre_fit, second.pre_fit]
    assert collection.listeners("post_val_batch") == []
    assert first.trainer is epochs.trainer
    with pytest.raises(KeyError):
        collection.listeners("pre_fti")


def test_rank_zero_callback_runs_only_on_rank_zero() -> None:
    class Printer(RankZeroCallback):
        def __init__(self) -> None:
            self.calls = 0

        def pre_fit(self) -> None:
            self.calls += 1

    for rank, expected in ((0, 1), (1, 0)):
        printer = Printer()
        collection = CallbackCollection([printer])
        collection.attach(FakeTrainer(rank=rank))
        collection.pre_fit()
        assert printer.calls == expected


def test_trainer_requirement_is_checked_on_attach() -> None:
    class NeedsCapability(Callback[Capability]):
        pass

    class Inherited(NeedsCapability):
        pass

    assert NeedsCapability.trainer_requirements() == (Capability,)
    assert Inherited.trainer_requirements() == (Capability,)
    CallbackCollection([Inherited()]).attach(CapableTrainer())
    with pytest.raises(TypeError, match="requires a trainer that is a Capability, but "
                                        "FakeTrainer is not"):
        CallbackCollection([Inherited()]).attach(FakeTrainer())


def test_misspelled_hook_is_rejected_with_a_suggestion() -> None:
    class Typo(Callback):
        def pre_trian_batch(self, batch: Any, batch_idx: int) -> None:
            pass

    with pytest.raises(AttributeError, match="pre_trian_batch .*did you mean 'pre_train_batch'"):
        CallbackCollection([Typo()])
    collection = CallbackCollection()
    with pytest.raises(AttributeError, match="on_exceptoin"):
        collection.append(type("Other", (Callback,), {"on_exceptoin": lambda self, e: None})())


def test_helpers_without_hook_prefixes_are_fine() -> None:
    class Helper(Callback):
        def _pre_compute(self) -> None:
            pass

        def summarize(self) -> None:
            pass

    assert len(CallbackCollection([Helper()])) == 1


def test_non_callbacks_are_rejected() -> None:
    with pytest.raises(TypeError, match="is not a Callback instance"):
        CallbackCollection([object()])  # type: ignore[list-item]


def test_state_dict_round_trip_with_duplicate_classes() -> None:
    class Counter(Callback):
        def __init__(self, count: int = 0) -> None:
            self.count = count

        def state_dict(self) -> dict[str, Any]:
            return {"count": self.count}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.count = state_dict["count"]

    saved = CallbackCollection([Counter(3), Counter(5)]).state_dict()
    assert list(saved.values()) == [{"count": 3}, {"count": 5}]
    assert list(saved)[1].endswith("Counter#1")
    restored = CallbackCollection([Counter(), Counter()])
    restored.load_state_dict(saved)
    assert [cb.count for cb in restored] == [3, 5]  # type: ignore[attr-defined]
