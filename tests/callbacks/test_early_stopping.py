"""EarlyStopping: when it stops, what it ignores, its errors, its state, and rank agreement."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import Any

import pytest

from dream_trainer.callbacks.early_stopping import EarlyStopping
from tests.helpers.launch import REPO, check, torchrun
from tests.helpers.toy import ToyTrainer, toy_config

STEPS_PER_EPOCH = 2  # n_samples=16 in batches of 8


class ScriptedValidation(ToyTrainer):
    """Validation reports ``VALUES[current_epoch]`` as ``val_score``."""

    VALUES: Sequence[float] = ()

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return {**super().validation_step(batch, batch_idx),
                "val_score": self.VALUES[self.current_epoch]}


def fit_scripted(values: Sequence[float], stopper: EarlyStopping,
                 **training: Any) -> ScriptedValidation:
    trainer_class = type("Scripted", (ScriptedValidation,), {"VALUES": tuple(values)})
    trainer = trainer_class(toy_config(callbacks=[stopper], n_samples=16,
                                       n_epochs=len(values), **training))
    trainer.fit()
    return trainer


def test_stops_after_patience_checks_without_improvement(caplog: pytest.LogCaptureFixture) -> None:
    stopper = EarlyStopping("val_score", patience=3)
    with caplog.at_level(logging.WARNING):
        trainer = fit_scripted([1.0, 0.5, 0.75, 0.5, 0.625, 0.25, 0.125], stopper)
    # Best 0.5 at epoch 1; epochs 2, 3 (equal is no improvement) and 4 do not beat it.
    assert (trainer.current_epoch, trainer.global_step) == (4, 5 * STEPS_PER_EPOCH)
    assert (stopper.best, stopper.wait) == (0.5, 3)
    assert "training stopped at global step 10: EarlyStopping: val_score did not improve on " \
           "its best 0.5 by more than 0.0 for 3 checks (patience 3)" in caplog.text


def test_an_improvement_resets_the_wait() -> None:
    stopper = EarlyStopping("val_score", patience=2)
    trainer = fit_scripted([1.0, 2.0, 0.5, 2.0, 1.0, 0.25], stopper)
    assert trainer.current_epoch == 4 and stopper.best == 0.5


def test_min_delta_and_max_mode() -> None:
    stopper = EarlyStopping("val_score", patience=2, min_delta=0.25)
    trainer = fit_scripted([1.0, 0.875, 0.75, 0.5], stopper)
    assert trainer.current_epoch == 2 and stopper.best == 1.0

    stopper = EarlyStopping("val_score", mode="max", patience=1)
    trainer = fit_scripted([0.25, 0.5, 0.5, 1.0], stopper)
    assert trainer.current_epoch == 2 and stopper.best == 0.5


def test_a_run_that_keeps_improving_is_not_stopped() -> None:
    stopper = EarlyStopping("val_score", patience=1)
    trainer = fit_scripted([1.0, 0.5, 0.25], stopper)
    assert trainer.current_epoch == 3 and stopper.wait == 0


def test_sanity_validation_is_not_a_check() -> None:
    # Counted, the sanity pass (epoch 0's value) would make epoch 0 a non-improvement.
    stopper = EarlyStopping("val_score", patience=1)
    trainer = fit_scripted([1.0, 0.5, 2.0, 0.25], stopper, num_sanity_val_steps=1)
    assert trainer.current_epoch == 2


def test_non_finite_value_stops_at_once(caplog: pytest.LogCaptureFixture) -> None:
    stopper = EarlyStopping("val_score", patience=5)
    with caplog.at_level(logging.WARNING):
        trainer = fit_scripted([1.0, 0.5, math.nan, 0.25], stopper)
    assert trainer.current_epoch == 2 and stopper.best == 0.5
    assert "val_score is nan, not finite (best 0.5, patience 5)" in caplog.text

    stopper = EarlyStopping("val_score", patience=2, check_finite=False)
    trainer = fit_scripted([1.0, math.inf, math.nan, 0.25], stopper)
    assert trainer.current_epoch == 2 and stopper.wait == 2


def test_training_key_is_checked_once_per_training_epoch() -> None:
    # lr=0: the training loss repeats exactly, so only the first epoch improves.
    stopper = EarlyStopping("loss", patience=2)
    trainer = ToyTrainer(toy_config(callbacks=[stopper], n_samples=16, n_epochs=6,
                                    optimizer="sgd", lr=0.0, val_every_n_steps=1))
    trainer.fit()
    # Validation runs after every step, but each epoch's training loss is checked once, by the
    # first validation after the epoch: epoch 0's sets the best, epochs 1 and 2 do not beat it,
    # so the first validation of epoch 3 stops the run.
    assert (trainer.current_epoch, trainer.global_step) == (3, 3 * STEPS_PER_EPOCH + 1)
    assert stopper.wait == 2


class NoValidation(ToyTrainer):
    def configure_dataloaders(self) -> tuple[Any, Any]:
        return super().configure_dataloaders()[0], None


def test_without_validation_loader_checks_after_each_training_epoch() -> None:
    stopper = EarlyStopping("loss", patience=1)
    trainer = NoValidation(toy_config(callbacks=[stopper], n_samples=16, n_epochs=5,
                                      optimizer="sgd", lr=0.0))
    trainer.fit()
    assert trainer.current_epoch == 1


def test_missing_monitor_names_the_available_keys() -> None:
    trainer = ToyTrainer(toy_config(callbacks=[EarlyStopping("val_los")], n_samples=16))
    with pytest.raises(ValueError, match=re.escape(
            "EarlyStopping monitor 'val_los' is in neither the validation nor the training "
            "results; available keys: ['grad_norm', 'loss', 'val_loss']")):
        trainer.fit()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"monitor": ""}, "must name a result key"),
    ({"monitor": "m", "mode": "lowest"}, "mode must be 'min' or 'max', got 'lowest'"),
    ({"monitor": "m", "patience": 0}, "patience must be at least 1, got 0"),
    ({"monitor": "m", "min_delta": -0.1}, "min_delta must be >= 0, got -0.1"),
    ({"monitor": "m", "min_delta": math.nan}, "min_delta must be >= 0, got nan"),
])
def test_invalid_arguments_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EarlyStopping(**kwargs)


def test_state_round_trip_through_the_trainer(caplog: pytest.LogCaptureFixture) -> None:
    stopper = EarlyStopping("val_score", patience=3)
    trainer = fit_scripted([1.0, 0.5, 0.75], stopper)
    saved = trainer.state_dict()["callbacks"]
    assert saved == {"EarlyStopping": {"monitor": "val_score", "mode": "min", "best": 0.5,
                                       "wait": 1}}

    restored = EarlyStopping("val_score", patience=3)
    ToyTrainer(toy_config(callbacks=[restored])).callbacks.load_state_dict(saved)
    assert (restored.best, restored.wait) == (0.5, 1)

    other = EarlyStopping("val_score", mode="max")
    with caplog.at_level(logging.WARNING):
        other.load_state_dict(saved["EarlyStopping"])
    assert (other.best, other.wait) == (-math.inf, 0)
    assert "starting from scratch" in caplog.text


@pytest.mark.distributed
def test_two_ranks_stop_at_the_same_step() -> None:
    result = check(torchrun(REPO / "tests/scripts/early_stopping_run.py", timeout=120))
    stops = dict(re.findall(r"rank (\d) stopped at global step (\d+)", result.stdout))
    # 160 samples over 2 ranks in batches of 8: 10 steps per epoch; rank 0 (patience 2) stops
    # after epoch 2, and rank 1 (patience 4) follows it.
    assert stops == {"0": "30", "1": "30"}, result.stdout + result.stderr
