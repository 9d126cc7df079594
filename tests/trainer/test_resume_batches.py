"""A resumed run continues the interrupted one's loop: the same global batch (another one is
refused), the checkpoint's step validated and its epoch ended once, a warning about discarded
gradients only when some were, and first-epoch checkpoints scored by a training key.

The toy run (``tests/helpers/checkpointing.py``): 80 samples, micro-batch 4, 2 micro-batches
per optimizer step, 10 steps per epoch, 3 epochs, a checkpoint every 4 steps and after every
epoch; the ends of epochs fall on steps 10, 20 and 30.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from dream_trainer.callbacks import Callback
from dream_trainer.checkpoint.directory import CheckpointError, complete_checkpoints
from tests.helpers.checkpointing import (CheckpointedTrainer, assert_same_state,
                                         checkpointed_config, final_state)
from tests.helpers.toy import ToyTrainer, toy_config

CHECKPOINTS = "ckpt/tests/run/checkpoints"
DISCARDED = "its gradients are discarded"


class Events(Callback):
    """Records the loop's epoch-level events as (hook, epoch, global step, detail)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, Any]] = []

    def _note(self, hook: str, detail: Any = None) -> None:
        self.events.append((hook, self.trainer.current_epoch, self.trainer.global_step, detail))

    def pre_train_epoch(self) -> None:
        self._note("pre_train_epoch")

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self._note("post_train_epoch", dict(result))

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        if not self.trainer.sanity_checking:
            self._note("validation")

    def post_epoch(self) -> None:
        self._note("post_epoch")


class Interrupt(Callback):
    """Interrupts the run once: a SIGUSR1 (preemption: the trainer saves at the end of the
    step and stops) after optimizer step ``step``, or an error in a hook at that step."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how = step, how

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        trainer = self.trainer
        if self.how == "preempt" and not trainer.is_accumulating_gradients \
                and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self._fail("post_train_epoch")

    def post_val_epoch(self, result: dict[str, Any]) -> None:
        self._fail("post_val_epoch")

    def _fail(self, hook: str) -> None:
        if self.how == hook and self.trainer.global_step == self.step:
            raise RuntimeError(f"interrupted in {hook} at step {self.step}")


def trainer(root: Path, *callbacks: Callback, trainer_class: type = CheckpointedTrainer,
            checkpoint: dict[str, Any] | None = None, **training: Any) -> CheckpointedTrainer:
    config = checkpointed_config(root, **(checkpoint or {}))
    config = config.model_copy(update={
        "training_parameters": config.training_parameters.model_copy(update=training)})
    run = trainer_class(config)
    for callback in callbacks:
        run.callbacks.append(callback)
    run.callbacks.attach(run)
    return run


def steps_saved(root: Path) -> list[int]:
    return [info.step for info in complete_checkpoints(root / CHECKPOINTS)]


# -- the global batch ------------------------------------------------------------------------
def refusal(saved: str, saved_factors: str, mine: str, mine_factors: str, ways: str) -> str:
    return (f"cannot resume with another global batch: the checkpoint's run took {saved} "
            f"samples per optimizer step ({saved_factors}) and this run takes {mine} "
            f"({mine_factors}), so its epochs would have another number of steps than the "
            f"step count and the schedule carried over assume. Keep the global batch at "
            f"{saved} (for example {ways}), or start a new run from the checkpoint's weights "
            "(SetupConfigMixin.init_weights_from=<the checkpoint's step directory>)")


@pytest.mark.parametrize("change, mine, mine_factors, ways", [
    ({"gradient_accumulation_steps": 1}, 4, "4 x 1 x 1",
     "gradient_accumulation_steps=2 or train_batch_size=8"),
    ({"train_batch_size": 8}, 16, "8 x 1 x 2",
     "gradient_accumulation_steps=1 or train_batch_size=4"),
])
def test_another_global_batch_is_refused_before_any_step(
        tmp_path: Path, change: dict[str, int], mine: int, mine_factors: str,
        ways: str) -> None:
    trainer(tmp_path, max_steps=12).fit()
    resumed = trainer(tmp_path, **change)
    with pytest.raises(CheckpointError) as error:
        resumed.fit()
    expected = refusal("8", "train_batch_size 4 x 1 data-parallel ranks x "
                       "gradient_accumulation_steps 2", str(mine), mine_factors, ways)
    assert str(error.value) == (f"failed to load checkpoint {tmp_path / CHECKPOINTS}/step_12: "
                                f"ValueError: {expected}")
    assert resumed.local_batches == 0


def two_rank_state(**position: int) -> dict[str, Any]:
    """The loop state of the issue's run: 2 data-parallel ranks of micro-batch 4 (a global
    batch of 8), saved after 3 steps of its first epoch."""
    return {"global_step": 3, "current_epoch": 0, "batch_in_epoch": 3, "samples_per_batch": 8,
            "dp_size": 2, "train_batch_size": 4, "gradient_accumulation_steps": 1, **position}


def test_one_rank_with_the_per_rank_batch_of_two_is_refused() -> None:
    resumed = ToyTrainer(toy_config(train_batch_size=4))
    with pytest.raises(ValueError) as error:
        resumed.load_state_dict(two_rank_state())
    assert str(error.value) == refusal(
        "8", "train_batch_size 4 x 2 data-parallel ranks x gradient_accumulation_steps 1",
        "4", "4 x 1 x 1", "gradient_accumulation_steps=2 or train_batch_size=8")


@pytest.mark.parametrize("layout", [{"train_batch_size": 8},
                                    {"train_batch_size": 4, "gradient_accumulation_steps": 2}])
def test_the_same_global_batch_on_another_layout_resumes(layout: dict[str, int]) -> None:
    resumed = ToyTrainer(toy_config(n_samples=160, **layout))
    resumed.load_state_dict(two_rank_state())
    resumed.fit()
    # 160 samples are 20 steps of 8; the first 3 (24 samples) were done.
    assert resumed.global_step == 20
    assert resumed.local_batches == 17 * layout.get("gradient_accumulation_steps", 1)


def test_under_fault_tolerance_each_replica_groups_batch_is_compared() -> None:
    # The number of replica groups varies by design: 3 groups' checkpoint, 2 groups now.
    resumed = ToyTrainer(toy_config(train_batch_size=4))
    resumed.world.join_replica_groups(0, 2)
    resumed.load_state_dict({**two_rank_state(current_epoch=1, batch_in_epoch=0),
                             "samples_per_batch": 12, "dp_size": 1})
    assert (resumed.global_step, resumed.current_epoch) == (3, 1)


class OlderWriter(CheckpointedTrainer):
    """Writes the loop state without the entries added since (as older versions did)."""

    def state_dict(self) -> dict[str, Any]:
        added = {"train_batch_size", "gradient_accumulation_steps", "validation_due",
                 "epoch_result"}
        return {key: value for key, value in super().state_dict().items() if key not in added}


def test_a_checkpoint_without_the_global_batch_resumes_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer(tmp_path, trainer_class=OlderWriter, max_steps=12).fit()
    resumed = trainer(tmp_path)
    resumed.fit()
    assert resumed.global_step == 30
    assert "the checkpoint does not record its gradient accumulation" in caplog.text


# -- what follows the checkpoint's step --------------------------------------------------------
Reference = tuple[list[tuple[str, int, int, Any]], dict[str, Any]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int | None, Reference]:
    """Each validation cadence's uninterrupted run: its events and final state."""
    runs = {}
    for every in (None, 4):
        events = Events()
        run = trainer(tmp_path_factory.mktemp("uninterrupted"), events, val_every_n_steps=every)
        run.fit()
        runs[every] = (events.events, final_state(run))
    return runs


# (optimizer step, how it is interrupted, the checkpoint it resumes from, validation every n)
INTERRUPTIONS = {
    # Preempted at the last step of epoch 1: the checkpoint is taken before the epoch ends.
    "preempted at an epoch's last step": (20, "preempt", 20, None),
    "preempted at an epoch's last step, which validates": (20, "preempt", 20, 4),
    "preempted mid-epoch at a step that validates": (12, "preempt", 12, 4),
    # Step 12's checkpoint is taken before its validation, which fails.
    "failed in the validation of a step": (12, "post_val_epoch", 12, 4),
    # Step 20's save waits for the epoch's end, which fails: step 16's is the newest.
    "failed in an epoch's end": (20, "post_train_epoch", 16, None),
}


def keys_only(events: list[tuple[str, int, int, Any]], epoch: int) -> list[Any]:
    """``events`` with the result keys instead of the values of ``epoch``'s training."""
    return [(hook, at, step, sorted(detail))
            if hook == "post_train_epoch" and at == epoch else (hook, at, step, detail)
            for hook, at, step, detail in events]


@pytest.mark.parametrize("name", INTERRUPTIONS)
def test_the_resumed_run_does_what_follows_the_checkpoint_once(
        name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        uninterrupted: dict[int | None, Reference]) -> None:
    at, how, step, validate_every = INTERRUPTIONS[name]
    events, state = uninterrupted[validate_every]
    first = trainer(tmp_path, Interrupt(at, how), val_every_n_steps=validate_every)
    try:
        first.fit()
    except RuntimeError as error:
        assert "interrupted in" in str(error)
    assert steps_saved(tmp_path)[-1] == step
    caplog.clear()
    resumed_events = Events()
    resumed = trainer(tmp_path, resumed_events, val_every_n_steps=validate_every)
    resumed.fit()
    # The resumed epoch starts again (pre_train_epoch); the rest is what the uninterrupted
    # run did after the checkpoint's step, the epoch's training results included.
    epoch = (step - 1) // 10
    expected = [("pre_train_epoch", epoch, step, None),
                *(event for event in events if event[2] >= step)]
    if step % 10:  # resumed mid-epoch, it reports the means over the batches it trained
        assert keys_only(resumed_events.events, epoch) == keys_only(expected, epoch)
    else:
        assert resumed_events.events == expected
    assert_same_state(final_state(resumed), state)
    assert DISCARDED not in caplog.text


@pytest.mark.parametrize("every_n_epochs", [None, 1])
def test_a_run_ended_at_an_epochs_last_step_and_extended_repeats_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, every_n_epochs: int | None,
        uninterrupted: dict[int | None, Reference]) -> None:
    events, state = uninterrupted[None]
    first_events, later_events = Events(), Events()
    checkpoint = {"every_n_epochs": every_n_epochs}
    trainer(tmp_path, first_events, checkpoint=checkpoint, max_steps=20).fit()
    # The save due at step 20 (every 4 steps) waited for the end of epoch 1: it holds it.
    assert steps_saved(tmp_path)[-2:] == [16, 20]
    later = trainer(tmp_path, later_events, checkpoint=checkpoint)
    later.fit()
    assert first_events.events + later_events.events == events
    assert_same_state(final_state(later), state)
    assert DISCARDED not in caplog.text


class ShortStream(IterableDataset):
    """5 micro-batches of 8 samples: the third accumulation window of 2 is never filled."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(0)
        for _ in range(40):
            yield torch.randn(8, generator=generator), torch.randn(4, generator=generator)


class ShortStreamTrainer(ToyTrainer):
    def configure_dataloaders(self) -> tuple[DataLoader[Any], None]:
        return DataLoader(ShortStream(), batch_size=8), None


def test_a_stream_that_ends_inside_a_window_discards_its_gradients(
        caplog: pytest.LogCaptureFixture) -> None:
    run = ShortStreamTrainer(toy_config(n_epochs=1, train_steps_per_epoch=3,
                                        gradient_accumulation_steps=2))
    with caplog.at_level(logging.WARNING):
        run.fit()
    assert (run.global_step, run.local_batches) == (2, 5)
    assert f"epoch 0 ended inside an accumulation window (batch 4); {DISCARDED}" in caplog.text
    assert all(param.grad is None for param in run.model.parameters())


# -- scores of first-epoch checkpoints ---------------------------------------------------------
class StepLosses(Callback):
    """The loss of every optimizer step as the run reports it (over the step's micro-batches
    and ranks), and the epochs' means."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.epoch_losses: list[float] = []

    def post_train_batch(self, result: dict[str, Any], batch_idx: int) -> None:
        if not self.trainer.is_accumulating_gradients:
            self.losses[self.trainer.global_step] = self.trainer.reduce_step_result()["loss"]

    def post_train_epoch(self, result: dict[str, Any]) -> None:
        self.epoch_losses.append(result["loss"])


@pytest.mark.parametrize("keep_top_k", [None, 1])
def test_first_epoch_checkpoints_are_scored_by_their_steps_training_value(
        tmp_path: Path, keep_top_k: int | None) -> None:
    losses = StepLosses()
    run = trainer(tmp_path, losses, n_epochs=1, checkpoint={
        "every_n_steps": 3, "monitor": "loss", "keep_top_k": keep_top_k, "resume": None})
    run.fit()
    scores = {step: losses.losses[step] for step in (3, 6, 9)}
    scores[10] = losses.epoch_losses[0]  # the epoch's end: its mean
    kept = {info.step: info.score for info in complete_checkpoints(tmp_path / CHECKPOINTS)}
    if keep_top_k is None:
        assert kept == scores
    else:
        best = min(scores, key=lambda step: scores[step])
        assert best != 10  # so that the newest alone would not pass
        assert kept == {step: scores[step] for step in (best, 10)}
