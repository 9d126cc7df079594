"""GarbageCollection: automatic gc off during fit(), restored after, collections on schedule."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from dream_trainer.callbacks import Callback
from dream_trainer.callbacks.garbage_collection import GarbageCollection
from dream_trainer.trainer import StopTraining
from tests.helpers.toy import ToyTrainer, toy_config


@pytest.fixture(autouse=True)
def _gc_enabled_around_each_test() -> Iterator[None]:
    gc.enable()
    yield
    leaked = not gc.isenabled()
    gc.enable()
    assert not leaked, "the test left automatic garbage collection disabled"


class GcProbe(Callback):
    """Records whether automatic gc is enabled at each training batch."""

    def __init__(self) -> None:
        self.enabled_in_batches: set[bool] = set()

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        self.enabled_in_batches.add(gc.isenabled())


class CollectLog:
    """Stands in for ``gc.collect``: records ``(trainer.global_step, generation)`` of the calls
    made while automatic collection is off (the trainer's teardown collects too, after)."""

    def __init__(self, trainer: ToyTrainer) -> None:
        self.trainer = trainer
        self.calls: list[tuple[int, int]] = []

    def __call__(self, generation: int = 2) -> int:
        if not gc.isenabled():
            self.calls.append((self.trainer.global_step, generation))
        return 0


def test_gc_is_off_during_fit_and_on_after() -> None:
    probe = GcProbe()
    ToyTrainer(toy_config(callbacks=[GarbageCollection(every_n_steps=5), probe])).fit()
    assert probe.enabled_in_batches == {False}
    assert gc.isenabled()


class FailsAtStepThree(ToyTrainer):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        if self.global_step == 3:
            raise RuntimeError("injected failure")
        return super().training_step(batch, batch_idx)


def test_gc_is_on_again_after_a_failed_fit() -> None:
    probe = GcProbe()
    with pytest.raises(RuntimeError, match="injected failure"):
        FailsAtStepThree(toy_config(callbacks=[GarbageCollection(), probe])).fit()
    assert probe.enabled_in_batches == {False}
    assert gc.isenabled()


def test_gc_disabled_before_fit_stays_disabled() -> None:
    gc.disable()
    ToyTrainer(toy_config(callbacks=[GarbageCollection()])).fit()
    assert not gc.isenabled()
    gc.enable()


def test_young_generations_every_n_steps_and_everything_at_epoch_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = ToyTrainer(toy_config(callbacks=[GarbageCollection(every_n_steps=4)], n_epochs=2,
                                    n_samples=160, gradient_accumulation_steps=2))
    log = CollectLog(trainer)
    monkeypatch.setattr(gc, "collect", log)
    trainer.fit()
    # 160 samples in batches of 8, 2 per optimizer step: 10 steps per epoch.
    assert trainer.global_step == 20
    assert log.calls == [(4, 1), (8, 1), (10, 2), (12, 1), (16, 1), (20, 1), (20, 2)]


def test_every_n_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every_n_steps must be at least 1, got 0"):
        GarbageCollection(every_n_steps=0)


class StopAfterFirstEpoch(Callback):
    def post_epoch(self) -> None:
        raise StopTraining("enough")


def test_gc_is_on_again_after_stop_training() -> None:
    ToyTrainer(toy_config(callbacks=[GarbageCollection(), StopAfterFirstEpoch()],
                          n_epochs=3)).fit()
    enabled = gc.isenabled()
    gc.enable()
    assert enabled
