"""The lifecycle hooks fire in the contract's order, with the right counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from dream_trainer.callbacks import HOOK_NAMES, Callback
from tests.helpers.toy import ToyTrainer, toy_config


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []


def _recording_hook(name: str) -> Any:
    def hook(self: Recorder, *args: Any) -> None:
        self.events.append(name)

    hook.__name__ = name
    return hook


for _name in HOOK_NAMES:
    setattr(Recorder, _name, _recording_hook(_name))


def expected_events(epochs: int, steps: int, accumulation: int, val_batches: int,
                    sanity: int = 0) -> list[str]:
    def validation(batches: int) -> list[str]:
        return ["pre_val_epoch", *["pre_val_batch", "post_val_batch"] * batches,
                "post_val_epoch"]

    def micro_batch(last_in_window: bool) -> list[str]:
        step = ["pre_optimizer_step", "post_optimizer_step"] if last_in_window else []
        return ["pre_train_batch", *step, "post_train_batch"]

    events = ["pre_launch", "pre_configure", "post_configure", "pre_setup", "post_setup",
              "pre_fit"]
    if sanity:
        events += validation(sanity)
    for _ in range(epochs):
        events += ["pre_epoch", "pre_train_epoch"]
        for _ in range(steps):
            for index in range(accumulation):
                events += micro_batch(index == accumulation - 1)
        events += ["post_train_epoch", *validation(val_batches), "post_epoch"]
    return events + ["post_fit"]


def test_hooks_fire_in_contract_order_with_counts() -> None:
    recorder = Recorder()
    config = toy_config(n_epochs=2, n_samples=64, train_batch_size=8,
                        gradient_accumulation_steps=2, val_samples=24, val_batch_size=8,
                        num_sanity_val_steps=1, callbacks=[recorder])
    trainer = ToyTrainer(config)
    trainer.fit()
    assert recorder.events == expected_events(epochs=2, steps=4, accumulation=2, val_batches=3,
                                              sanity=1)
    counts = Counter(recorder.events)
    assert counts["post_optimizer_step"] == trainer.global_step == 8
    assert counts["pre_train_batch"] == trainer.local_batches == 16
    assert trainer.current_epoch == 2


def test_trainer_hooks_run_before_callbacks() -> None:
    order: list[str] = []

    class Cb(Callback):
        def pre_fit(self) -> None:
            order.append("callback")

    class Trainer(ToyTrainer):
        def pre_fit(self) -> None:
            order.append("trainer")

    Trainer(toy_config(callbacks=[Cb()], max_steps=1)).fit()
    assert order == ["trainer", "callback"]


def test_on_exception_fires_and_the_error_propagates() -> None:
    recorder = Recorder()

    class Failing(ToyTrainer):
        def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
            if self.global_step == 2:
                raise ValueError("boom")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="boom") as info:
        Failing(toy_config(callbacks=[recorder])).fit()
    assert recorder.events[-1] == "on_exception"
    assert "post_fit" not in recorder.events
    assert recorder.events.count("post_optimizer_step") == 2
    assert "raised on rank 0 of 1 (epoch 0, global step 2, batch 2)" in str(info.value.__notes__)
